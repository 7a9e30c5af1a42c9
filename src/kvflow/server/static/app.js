// kvflow's page: a chat over /v1/chat/completions and a live view fed by /v1/engine/snapshot.
// Plain JavaScript, no dependencies. The conversation, settings and API key stay in this
// browser (localStorage).
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "kvflow.page.v1";
const POLL_MS = 500;
const WINDOW_S = 300;

const state = {
  key: localStorage.getItem(STORE + ".key") || "",
  model: null,
  messages: [], // {role, content, stats?}
  busy: null, // AbortController of the answer being streamed
  defaults: {},
  snapshot: null,
  needKey: false,
};

// ---- HTTP -------------------------------------------------------------------------------

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function api(path, init) {
  const response = await fetch(path, Object.assign({}, init, { headers: headers(init && init.headers) }));
  if (response.status === 401) askForKey(Boolean(state.key));
  return response;
}

function askForKey(refused) {
  state.needKey = true;
  $("key-error").hidden = !refused;
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

$("key-form").addEventListener("submit", () => {
  state.key = $("key-input").value.trim();
  localStorage.setItem(STORE + ".key", state.key);
  state.needKey = false;
  loadModel();
});
$("key-button").addEventListener("click", () => askForKey(false));

async function loadModel() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) return;
    const body = await response.json();
    state.model = body.data[0].id;
    $("model-name").textContent = state.model + " · max_model_len " + body.data[0].max_model_len;
  } catch (e) {
    $("model-name").textContent = "server unreachable";
  }
}

// ---- chat -------------------------------------------------------------------------------

function save() {
  const settings = {};
  for (const id of ["system", "temperature", "top_p", "max_tokens", "seed"]) settings[id] = $(id).value;
  localStorage.setItem(STORE + ".chat", JSON.stringify({ messages: state.messages, settings }));
}

function restore() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE + ".chat") || "{}");
    state.messages = saved.messages || [];
    for (const [id, value] of Object.entries(saved.settings || {})) $(id).value = value;
  } catch (e) {
    state.messages = [];
  }
}

function statsLine(s) {
  if (!s) return "";
  const parts = [];
  if (s.completion_tokens != null) parts.push(s.completion_tokens + " tokens");
  if (s.tps != null) parts.push(s.tps.toFixed(1) + " tok/s");
  if (s.ttft != null) parts.push("first token " + Math.round(s.ttft * 1000) + " ms");
  if (s.prompt_tokens != null) parts.push(s.prompt_tokens + " prompt tokens");
  if (s.finish) parts.push("finish: " + s.finish);
  return parts.join(" · ");
}

function renderMessage(m) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = m.content;
  div.appendChild(text);
  if (m.role === "assistant") {
    const stats = document.createElement("span");
    stats.className = "stats";
    stats.textContent = statsLine(m.stats);
    div.appendChild(stats);
  }
  return div;
}

function renderChat() {
  const box = $("messages");
  box.replaceChildren(...state.messages.map(renderMessage));
  box.scrollTop = box.scrollHeight;
  $("regenerate").disabled = Boolean(state.busy) || !state.messages.some((m) => m.role === "user");
  $("send").disabled = Boolean(state.busy);
  $("stop").disabled = !state.busy;
}

function requestBody() {
  const body = {
    model: state.model || undefined,
    stream: true,
    stream_options: { include_usage: true },
    messages: [],
  };
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const m of state.messages) {
    if (m.role === "user" || m.role === "assistant") body.messages.push({ role: m.role, content: m.content });
  }
  const numbers = { temperature: parseFloat, top_p: parseFloat, max_tokens: parseInt, seed: parseInt };
  for (const [field, parse] of Object.entries(numbers)) {
    const value = parse($(field).value);
    if (!Number.isNaN(value)) body[field] = value;
  }
  return body;
}

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function answer() {
  const controller = new AbortController();
  state.busy = controller;
  const reply = { role: "assistant", content: "", stats: {} };
  const body = requestBody();
  state.messages.push(reply);
  renderChat();
  const node = $("messages").lastElementChild;
  node.classList.add("streaming");
  const textNode = node.querySelector(".text");
  const statsNode = node.querySelector(".stats");
  const start = performance.now();
  let first = null;
  let last = null;
  let chunks = 0;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || response.statusText);
    }
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the request failed");
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && choice.delta.content) {
        const now = performance.now();
        if (first === null) first = now;
        last = now;
        chunks += 1;
        reply.content += choice.delta.content;
        textNode.textContent = reply.content;
        $("messages").scrollTop = $("messages").scrollHeight;
      }
      if (choice && choice.finish_reason) reply.stats.finish = choice.finish_reason;
      if (chunk.usage) {
        reply.stats.completion_tokens = chunk.usage.completion_tokens;
        reply.stats.prompt_tokens = chunk.usage.prompt_tokens;
      }
      reply.stats.ttft = first === null ? null : (first - start) / 1000;
      const n = reply.stats.completion_tokens || chunks;
      if (first !== null && last > first && n > 1) reply.stats.tps = ((n - 1) * 1000) / (last - first);
      statsNode.textContent = statsLine(reply.stats);
    }
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stats.finish = "stopped";
    } else {
      state.messages.push({ role: "error", content: "Error: " + e.message });
    }
  } finally {
    state.busy = null;
    save();
    renderChat();
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.busy) return;
  $("input").value = "";
  state.messages.push({ role: "user", content: text });
  answer();
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.busy && state.busy.abort());
$("regenerate").addEventListener("click", () => {
  if (state.busy) return;
  while (state.messages.length && state.messages[state.messages.length - 1].role !== "user") {
    state.messages.pop();
  }
  if (state.messages.length) answer();
});
$("clear").addEventListener("click", () => {
  if (state.busy) state.busy.abort();
  state.messages = [];
  save();
  renderChat();
});
for (const id of ["system", "temperature", "top_p", "max_tokens", "seed"]) $(id).addEventListener("change", save);

// ---- the engine, live ---------------------------------------------------------------------

function hue(text) {
  let h = 0;
  for (let i = 0; i < text.length; i++) h = (h * 31 + text.charCodeAt(i)) >>> 0;
  return h % 360;
}
const requestColor = (id) => `hsl(${hue(id)}, 62%, 52%)`;
const short = (id) => (id.length > 22 ? id.slice(0, 10) + "…" + id.slice(-8) : id);

const MAX_CELLS = 16384;
const RANK = { n: 0, ".": 1, c: 2, h: 3, s: 4 };

// Large pools (a GPU's hundreds of thousands of blocks) draw one cell per `group` blocks,
// in the state of its busiest block.
function cells(engine) {
  const n = engine.num_blocks;
  const group = Math.ceil(n / MAX_CELLS);
  if (group === 1) return { states: engine.blocks, group };
  let states = "";
  for (let start = 0; start < n; start += group) {
    let best = ".";
    for (let i = start; i < Math.min(n, start + group); i++) {
      const s = engine.blocks[i];
      if (RANK[s] > RANK[best]) best = s;
    }
    states += best;
  }
  return { states, group };
}

function drawKV(engine) {
  const canvas = $("kv-map");
  const { states, group } = cells(engine);
  const n = states.length;
  const width = canvas.clientWidth || 600;
  const cell = n <= 512 ? 12 : n <= 2048 ? 8 : n <= 8192 ? 5 : 3;
  const gap = cell > 4 ? 2 : 1;
  const perRow = Math.max(1, Math.floor(width / (cell + gap)));
  const rows = Math.ceil(n / perRow);
  const dpr = window.devicePixelRatio || 1;
  canvas.style.height = rows * (cell + gap) + "px";
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(rows * (cell + gap) * dpr);
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  const owner = new Map(); // cell -> the first request holding a block in it
  for (const r of engine.running) {
    for (const b of r.block_ids) if (!owner.has(Math.floor(b / group))) owner.set(Math.floor(b / group), r.request_id);
  }
  const css = getComputedStyle(document.documentElement);
  const colors = { ".": css.getPropertyValue("--free"), c: css.getPropertyValue("--cached"), s: css.getPropertyValue("--shared"), n: css.getPropertyValue("--null"), h: "#8a94a3" };
  const counts = { h: 0, s: 0, c: 0, ".": 0 };
  for (const s of engine.blocks) counts[s] = (counts[s] || 0) + 1;
  for (let i = 0; i < n; i++) {
    const s = states[i];
    ctx.fillStyle = s === "h" && owner.has(i) ? requestColor(owner.get(i)) : colors[s];
    ctx.fillRect((i % perRow) * (cell + gap), Math.floor(i / perRow) * (cell + gap), cell, cell);
  }
  $("kv-held").textContent = counts.h;
  $("kv-shared").textContent = counts.s;
  $("kv-cached").textContent = counts.c;
  $("kv-free").textContent = counts["."];
  const per = group > 1 ? `; one cell per ${group} blocks` : "";
  $("kv-geometry").textContent = `${engine.num_blocks} blocks × ${engine.block_size} tokens (block 0 reserved${per})`;
  canvas._layout = { perRow, cell, gap, owner, blocks: states, group };
}

$("kv-map").addEventListener("mousemove", (event) => {
  const canvas = $("kv-map");
  const tip = $("kv-tip");
  const layout = canvas._layout;
  if (!layout) return;
  const rect = canvas.getBoundingClientRect();
  const x = event.clientX - rect.left;
  const y = event.clientY - rect.top;
  const i = Math.floor(y / (layout.cell + layout.gap)) * layout.perRow + Math.floor(x / (layout.cell + layout.gap));
  const s = layout.blocks[i];
  if (s === undefined) { tip.hidden = true; return; }
  const names = { n: "null block (reserved)", ".": "free", c: "free, prefix-cached", h: "held", s: "shared prefix" };
  const who = layout.owner.get(i);
  const which = layout.group > 1 ? `blocks ${i * layout.group}–${(i + 1) * layout.group - 1}` : `block ${i}`;
  tip.textContent = `${which}: ${names[s]}${who ? " by " + short(who) : ""}`;
  tip.style.left = Math.min(x + 12, rect.width - 200) + "px";
  tip.style.top = y + 12 + "px";
  tip.hidden = false;
});
$("kv-map").addEventListener("mouseleave", () => { $("kv-tip").hidden = true; });

function requestRow(r, running) {
  const li = document.createElement("li");
  li.dataset.requestId = r.request_id;
  const dot = document.createElement("span");
  dot.className = "dot";
  dot.style.background = running ? requestColor(r.request_id) : "#c4cad2";
  const id = document.createElement("span");
  id.className = "id";
  id.textContent = short(r.request_id);
  id.title = r.request_id;
  const info = document.createElement("span");
  info.className = "muted";
  const bar = document.createElement("div");
  bar.className = "bar";
  const fill = document.createElement("span");
  const total = r.num_prompt_tokens + r.num_output_tokens;
  if (running && r.num_computed_tokens < r.num_prompt_tokens) {
    fill.className = "prefill";
    fill.style.width = (100 * r.num_computed_tokens) / r.num_prompt_tokens + "%";
    info.textContent = `prefill ${r.num_computed_tokens}/${r.num_prompt_tokens} · ${r.block_ids.length} blocks`;
  } else if (running) {
    fill.style.width = (100 * r.num_output_tokens) / Math.max(1, r.max_tokens) + "%";
    info.textContent = `${r.num_output_tokens}/${r.max_tokens} out · ${r.block_ids.length} blocks`;
  } else {
    info.textContent = `${r.wait_reason} · ${total} tokens · ${r.age_s.toFixed(1)} s` + (r.num_preemptions ? ` · preempted ×${r.num_preemptions}` : "");
  }
  bar.appendChild(fill);
  li.append(dot, id, info);
  if (running) li.appendChild(bar);
  return li;
}

function renderList(id, rows, running, empty) {
  const ul = $(id);
  if (!rows.length) {
    const li = document.createElement("li");
    li.className = "empty";
    li.textContent = empty;
    ul.replaceChildren(li);
  } else {
    ul.replaceChildren(...rows.map((r) => requestRow(r, running)));
  }
}

function renderEvents(events) {
  const ul = $("events");
  if (!events.length) return;
  ul.replaceChildren(...events.slice().reverse().map((e) => {
    const li = document.createElement("li");
    const kind = document.createElement("span");
    kind.className = "kind " + e.kind;
    kind.textContent = e.kind;
    const when = new Date(e.time * 1000).toLocaleTimeString();
    li.append(kind, `${when} ${short(e.request_id)}: ${e.message}`);
    return li;
  }));
}

function perSecond(history, fields, now) {
  const index = Object.fromEntries(fields.map((f, i) => [f, i]));
  const bySecond = new Map(history.map((row) => [row[0], row]));
  const end = Math.floor(now);
  const out = [];
  for (let t = end - WINDOW_S + 1; t <= end; t++) {
    const row = bySecond.get(t);
    const get = (f) => (row ? row[index[f]] : 0);
    out.push({
      t,
      steps: get("steps"),
      tps: get("gen_tokens"),
      ttft: get("ttft_n") ? get("ttft_sum") / get("ttft_n") : null,
      ttftMax: get("ttft_n") ? get("ttft_max") : null,
      itl: get("itl_n") ? (1000 * get("itl_sum")) / get("itl_n") : null,
      itlMax: get("itl_n") ? 1000 * get("itl_max") : null,
    });
  }
  return out;
}

function plot(id, points, key, maxKey, color) {
  const canvas = $(id);
  const w = canvas.clientWidth || 300;
  const h = canvas.clientHeight || 80;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  const values = points.flatMap((p) => [p[key], maxKey ? p[maxKey] : null]).filter((v) => v != null);
  const top = Math.max(1e-9, ...values) * 1.1;
  const pad = 4;
  const x = (i) => pad + ((w - 2 * pad) * i) / (points.length - 1);
  const y = (v) => h - 14 - ((h - 20) * v) / top;
  ctx.strokeStyle = "#e3e6ea";
  ctx.beginPath();
  ctx.moveTo(pad, y(0) + 0.5);
  ctx.lineTo(w - pad, y(0) + 0.5);
  ctx.stroke();
  ctx.fillStyle = "#6b7480";
  ctx.font = "10px system-ui, sans-serif";
  const fmt = (v) => (v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2));
  ctx.fillText(values.length ? "max " + fmt(Math.max(...values)) : "no data", pad, 10);
  ctx.fillText("-5 min", pad, h - 2);
  ctx.fillText("now", w - pad - 18, h - 2);
  const line = (k, style, width) => {
    ctx.strokeStyle = style;
    ctx.lineWidth = width;
    ctx.beginPath();
    let open = false;
    points.forEach((p, i) => {
      if (p[k] == null) { open = false; return; }
      if (open) ctx.lineTo(x(i), y(p[k])); else ctx.moveTo(x(i), y(p[k]));
      open = true;
    });
    ctx.stroke();
    ctx.fillStyle = style;
    points.forEach((p, i) => { if (p[k] != null) ctx.fillRect(x(i) - 1, y(p[k]) - 1, 2, 2); });
  };
  if (maxKey) line(maxKey, color + "55", 1);
  line(key, color, 1.5);
}

function render(snapshot) {
  const e = snapshot.engine;
  $("health").className = "health " + (snapshot.healthy ? "ok" : "bad");
  $("health").title = snapshot.healthy ? "engine healthy" : "engine unhealthy (see /health)";
  drawKV(e);
  let held = 0;
  for (const s of e.blocks) if (s === "h" || s === "s") held += 1;
  $("t-running").textContent = e.running.length;
  $("t-waiting").textContent = e.waiting.length;
  $("t-kv").textContent = Math.round((100 * held) / Math.max(1, e.num_blocks - 1)) + "%";
  $("t-preempt").textContent = e.num_preemptions_total;
  $("running-count").textContent = `${e.running.length} of max_num_seqs ${e.max_num_seqs}`;
  renderList("running", e.running, true, "Nothing running.");
  renderList("waiting", e.waiting, false, "Nothing waiting.");
  const reasons = $("waiting-reasons");
  reasons.replaceChildren(...Object.entries(e.waiting_by_reason).map(([reason, count]) => {
    const chip = document.createElement("span");
    chip.className = "chip " + reason;
    chip.dataset.reason = reason;
    chip.textContent = `${reason} ${count}`;
    return chip;
  }));
  renderEvents(e.events);
  const points = perSecond(snapshot.history, snapshot.history_fields, e.time);
  const recent = points.slice(-6, -1); // the last five whole seconds
  const mean = (k) => recent.reduce((a, p) => a + p[k], 0) / recent.length;
  $("t-steps").textContent = mean("steps").toFixed(1);
  $("t-tps").textContent = mean("tps").toFixed(0);
  plot("p-steps", points, "steps", null, "#2f6fed");
  plot("p-tps", points, "tps", null, "#1f9d55");
  plot("p-ttft", points, "ttft", "ttftMax", "#d98b0a");
  plot("p-itl", points, "itl", "itlMax", "#8e44ad");
  const d = snapshot.sampling_defaults || {};
  const text = Object.entries(d).map(([k, v]) => `${k} ${v}`).join(", ");
  $("defaults").textContent = text || "none";
  for (const field of ["temperature", "top_p", "max_tokens"]) {
    $(field).placeholder = d[field] != null ? String(d[field]) : "";
  }
}

async function poll() {
  if (document.visibilityState === "visible" && !state.needKey) {
    try {
      const response = await api(`/v1/engine/snapshot?history_s=${WINDOW_S}`);
      if (response.ok) {
        state.snapshot = await response.json();
        render(state.snapshot);
        $("snapshot-age").textContent = "updated " + new Date().toLocaleTimeString();
      } else if (response.status !== 401) {
        $("health").className = "health bad";
      }
    } catch (e) {
      $("health").className = "health bad";
      $("snapshot-age").textContent = "server unreachable";
    }
  }
  setTimeout(poll, POLL_MS);
}

restore();
renderChat();
loadModel();
poll();
