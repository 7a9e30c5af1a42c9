"""Twenty-one pydantic models for the structured-output tests: nested objects, arrays with
bounds, enums, numbers with bounds, optional fields, string patterns and lengths, anyOf. Strings
are short and arrays small so that the embedded model ends every one within MAX_TOKENS."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

MAX_TOKENS = 160
Short = Annotated[str, Field(max_length=10)]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


class Point(BaseModel):
    x: float = Field(ge=-100, le=100)
    y: float = Field(ge=-100, le=100)


class Paint(BaseModel):
    color: Literal["red", "green", "blue"]


class Tags(BaseModel):
    tags: list[Short] = Field(min_length=1, max_length=3)


class Address(BaseModel):
    city: str = Field(max_length=16)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class User(BaseModel):
    name: str = Field(max_length=16)
    address: Address


class Item(BaseModel):
    name: str = Field(max_length=16)
    price: float | None = Field(default=None, ge=0, le=1000)


class Value(BaseModel):
    value: Annotated[int, Field(ge=0, le=999)] | Short


class Flag(BaseModel):
    ok: bool


class Code(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{2}$")


class Day(BaseModel):
    day: int = Field(ge=1, le=31)
    month: int = Field(ge=1, le=12)


class Role(enum.Enum):
    ADMIN = "admin"
    GUEST = "guest"


class Member(BaseModel):
    name: str = Field(max_length=10)
    role: Role


class Team(BaseModel):
    members: list[Member] = Field(min_length=1, max_length=2)


class Scores(BaseModel):
    scores: list[Annotated[int, Field(ge=0, le=100)]] = Field(min_length=2, max_length=4)


class Leaf(BaseModel):
    value: int = Field(ge=-9, le=9)


class Branch(BaseModel):
    leaf: Leaf


class Tree(BaseModel):
    branch: Branch


class Status(BaseModel):
    status: Literal["ok"]
    count: int = Field(ge=0, le=99)


class Cat(BaseModel):
    meows: bool


class Dog(BaseModel):
    barks: bool


class Pet(BaseModel):
    pet: Cat | Dog


class Temperature(BaseModel):
    celsius: float = Field(gt=-50, lt=50)


class Author(BaseModel):
    name: str = Field(max_length=16)


class Book(BaseModel):
    title: str = Field(max_length=20)
    author: Author | None = None


class Keywords(BaseModel):
    keywords: list[Short] = Field(max_length=2)


class Product(BaseModel):
    id: int = Field(ge=1, le=9999)
    name: str = Field(max_length=12)
    in_stock: bool
    sizes: list[Literal["S", "M", "L"]] = Field(max_length=3)


class Login(BaseModel):
    # xgrammar enforces a pattern alone (its length bounds too would be ignored)
    username: str = Field(min_length=3, max_length=12, pattern=r"^[a-z]{3,12}$")


MODELS: list[type[BaseModel]] = [
    Person, Point, Paint, Tags, User, Item, Value, Flag, Code, Day, Team, Scores, Tree, Status,
    Pet, Temperature, Book, Keywords, Product, Login, Address,
]  # fmt: skip
