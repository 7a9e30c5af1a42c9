"""Grammar-constrained decoding on xgrammar: compiling constraints (`backend`, engine side) and
masking the logits of constrained rows with per-request matchers (`bitmask`, runner side)."""
