"""A GBNF grammar checked before llama.cpp sees it: its syntax, its size and nesting, and how
many parse positions one character can open.

llama.cpp's grammar parser (src/llama-grammar.cpp) recurses once per nesting level without a
bound (20,000 nested parentheses overflow the stack: a SIGSEGV that ends the server) and prints
the whole grammar to stderr when it refuses one. Its sampler keeps one stack per position a
sampled token may continue from, and checks every candidate token against every stack; a run
of items that may each be empty (`[a-b]? [a-b]? ...`, or rules whose every item is optional)
opens one position per item, and a token of c characters is matched along every way those
positions combine (about w^c / c!): 40 such items cost 0.3 s per token on a 49k vocabulary, 80
cost 11 s. Literal alternatives (`"a" | "b" | ...`) and nested optionals (`x{0,300}`, JSON
strings) stay cheap. So the check parses the grammar with llama.cpp's syntax (without
recursion past `max_depth`) and bounds its *width*: the most parse positions reachable from
one place without consuming a character (the items of a leading run of optional ones, through
rule references). A grammar past a bound is refused with a message that names the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ..errors import SparkError

WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
HEX = {"x": 2, "u": 4, "U": 8}
WIDE = 32  # a class of this many characters or more is wide: most tokens' characters match it
MAX_REPETITION = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD: a larger {m} is refused, a larger n unbounded


class GrammarError(SparkError):
    """A grammar that is not valid GBNF, is over a bound, or (from a schema) that no value satisfies."""

    exit_code = 2


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds a grammar must stay within (serve's --grammar-max-* flags)."""

    max_bytes: int = 256 * 1024  # UTF-8 bytes of the GBNF text
    max_depth: int = 64          # nested parentheses within one rule
    max_width: int = 16          # weighted parse positions one place can open (see width)


@dataclass
class _Item:
    kind: str                    # "t": a terminal (char, class, token, any); "ref": a rule; "rep": a repetition
    name: str = ""               # ref: the rule's name (a group is an anonymous rule)
    lo: int = 1                  # rep: the least and most repetitions (hi None: unbounded)
    hi: int | None = 1
    inner: "_Item | None" = None
    size: int = 1                # t: the characters it consumes (a literal's length; 1 for a class, `.`, a token)
    wide: bool = False           # t: matches most characters (`.`, a negated class, a class of WIDE or more)


@dataclass
class Grammar:
    """The rules by name, each a list of alternatives, each a list of items."""

    rules: dict[str, list[list[_Item]]] = field(default_factory=dict)
    refs: set[str] = field(default_factory=set)


class _Parser:
    """llama.cpp's GBNF syntax, recursive only per group (bounded by max_depth before parsing)."""

    def __init__(self, text: str):
        self.s, self.n, self.g, self.n_anon = text, len(text), Grammar(), 0

    def fail(self, what: str, pos: int) -> GrammarError:
        line = self.s.count("\n", 0, pos) + 1
        return GrammarError(f"{what} at line {line}, column {pos - (self.s.rfind(chr(10), 0, pos) + 1) + 1}")

    def space(self, i: int, newline_ok: bool) -> int:
        s, n = self.s, self.n
        while i < n and (s[i] in " \t#" or (newline_ok and s[i] in "\r\n")):
            if s[i] == "#":
                while i < n and s[i] not in "\r\n":
                    i += 1
            else:
                i += 1
        return i

    def name(self, i: int) -> int:
        j = i
        while j < self.n and self.s[j] in WORD:
            j += 1
        if j == i:
            raise self.fail("expecting a rule name", i)
        return j

    def char(self, i: int) -> int:
        s = self.s
        if i >= self.n:
            raise self.fail("unexpected end of input", i)
        if s[i] != "\\":
            return i + 1
        c = s[i + 1] if i + 1 < self.n else ""
        if c in HEX:
            digits = s[i + 2:i + 2 + HEX[c]]
            if len(digits) != HEX[c] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"expecting {HEX[c]} hex digits after \\{c}", i)
            return i + 2 + HEX[c]
        if c in ESCAPES:
            return i + 2
        raise self.fail("unknown escape", i)

    def codepoint(self, i: int) -> tuple[int, int]:
        """The character at i (an escape decoded) and where the next one starts."""
        j = self.char(i)
        if self.s[i] != "\\":
            return ord(self.s[i]), j
        c = self.s[i + 1]
        return (int(self.s[i + 2:j], 16) if c in HEX else ord(ESCAPES[c])), j

    def parse(self) -> Grammar:
        i = self.space(0, True)
        while i < self.n:
            j = self.name(i)
            rule = self.s[i:j]
            i = self.space(j, False)
            if not self.s.startswith("::=", i):
                raise self.fail("expecting ::=", i)
            alts, i = self.alternates(self.space(i + 3, True), False)
            self.g.rules.setdefault(rule, []).extend(alts)
            if i < self.n and self.s[i] in "\r\n":
                i += 2 if self.s.startswith("\r\n", i) else 1
            elif i < self.n:
                raise self.fail("expecting a newline or the end", i)
            i = self.space(i, True)
        missing = sorted(self.g.refs - self.g.rules.keys())
        if missing:
            raise GrammarError(f"undefined rule {missing[0]!r}")
        return self.g

    def alternates(self, i: int, nested: bool) -> tuple[list[list[_Item]], int]:
        seq, i = self.sequence(i, nested)
        alts = [seq]
        while i < self.n and self.s[i] == "|":
            seq, i = self.sequence(self.space(i + 1, True), nested)
            alts.append(seq)
        return alts, i

    def sequence(self, i: int, nested: bool) -> tuple[list[_Item], int]:
        s, seq = self.s, []
        while i < self.n:
            c = s[i]
            if c == '"':
                i += 1
                chars, distinct = 0, set()
                while i >= self.n or s[i] != '"':
                    if i >= self.n:
                        raise self.fail("unexpected end of input in a string", i)
                    cp, i = self.codepoint(i)
                    chars += 1
                    distinct.add(cp)
                # NOTE: "" matches nothing: an empty sequence, which may be repeated or made optional.
                # One character repeated ("        ", "====") is as short as one: vocabularies hold
                # long runs of it, which span many such items
                size = 1 if len(distinct) == 1 else chars
                seq.append(_Item("t", size=size) if chars else _Item("rep", lo=0, hi=0, inner=_Item("t")))
                i = self.space(i + 1, nested)
            elif c == "[":
                negated = s.startswith("^", i + 1)
                i += 1 + negated
                covered = 0
                while i >= self.n or s[i] != "]":
                    if i >= self.n:
                        raise self.fail("unexpected end of input in a character class", i)
                    lo, i = self.codepoint(i)
                    hi = lo
                    if s.startswith("-", i) and i + 1 < self.n and s[i + 1] != "]":
                        hi, i = self.codepoint(i + 1)
                    covered += max(0, hi - lo + 1)
                seq.append(_Item("t", wide=negated or covered >= WIDE))
                i = self.space(i + 1, nested)
            elif c in "<!":
                i = self.token(i + (c == "!"))
                seq.append(_Item("t"))
                i = self.space(i, nested)
            elif c in WORD:
                j = self.name(i)
                self.g.refs.add(s[i:j])
                seq.append(_Item("ref", s[i:j]))
                i = self.space(j, nested)
            elif c == "(":
                alts, i = self.alternates(self.space(i + 1, True), True)
                if i >= self.n or s[i] != ")":
                    raise self.fail("expecting ')'", i)
                self.n_anon += 1
                anon = f"({self.n_anon})"
                self.g.rules[anon] = alts
                seq.append(_Item("ref", anon))
                i = self.space(i + 1, nested)
            elif c == ".":
                seq.append(_Item("t", wide=True))
                i = self.space(i + 1, nested)
            elif c in "*+?{":
                if not seq:
                    raise self.fail(f"expecting an item before {c!r}", i)
                (lo, hi), i = self.repetition(i, nested)
                seq[-1] = _Item("rep", lo=lo, hi=hi, inner=seq[-1])
            else:
                break
        return seq, i

    def repetition(self, i: int, nested: bool) -> tuple[tuple[int, int | None], int]:
        c = self.s[i]
        if c != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c], self.space(i + 1, nested)
        i = self.space(i + 1, nested)
        lo, i = self.integer(i)
        i = self.space(i, nested)
        hi: int | None = lo
        if i < self.n and self.s[i] == ",":
            i = self.space(i + 1, nested)
            hi = None
            if i < self.n and self.s[i].isdigit():
                hi, i = self.integer(i)
                i = self.space(i, nested)
        if i >= self.n or self.s[i] != "}":
            raise self.fail("expecting '}'", i)
        if lo > MAX_REPETITION:
            raise self.fail(f"a repetition of more than {MAX_REPETITION}", i)
        if hi is not None and hi > MAX_REPETITION:
            hi = None
        return (lo, hi), self.space(i + 1, nested)

    def integer(self, i: int) -> tuple[int, int]:
        j = i
        while j < self.n and self.s[j].isascii() and self.s[j].isdigit():
            j += 1
        if j == i or j - i > 12:
            raise self.fail("expecting a number", i)
        return int(self.s[i:j]), j

    def token(self, i: int) -> int:
        if i >= self.n or self.s[i] != "<":
            raise self.fail("expecting '<'", i)
        end = self.s.find(">", i + 1)
        if end < 0:
            raise self.fail("expecting '>'", i)
        return end + 1


def depth(text: str) -> int:
    """The deepest nesting of parentheses outside strings, classes, tokens and comments."""
    deepest = level = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] not in "\r\n":
                i += 1
        elif c == "(":
            level += 1
            deepest = max(deepest, level)
        elif c == ")":
            level = max(0, level - 1)
        i += 1
    return deepest


def regex_depth(pattern: str) -> int:
    """The deepest nesting of groups in a regular expression (escapes and classes skipped): a
    schema's `pattern` becomes one GBNF group per level."""
    deepest = level = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            i += 1 + pattern.startswith("]", i + 1)
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            level += 1
            deepest = max(deepest, level)
        elif c == ")":
            level = max(0, level - 1)
        i += 1
    return deepest


def schema_patterns(schema: object) -> Iterator[tuple[str, str]]:
    """Each regular expression of a JSON Schema (`pattern` values, `patternProperties` keys),
    with where it is (a dotted path)."""
    todo: list[tuple[object, str]] = [(schema, "")]
    while todo:
        v, where = todo.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            at = f"{where}.{k}" if where else str(k)
            if k == "pattern" and isinstance(x, str) and isinstance(v, dict):
                yield x, at
            elif k == "patternProperties" and isinstance(x, dict):
                yield from ((key, f"{at}.{key[:40]}") for key in x)
            todo.append((x, at))


def check_patterns(schema: object, limits: "GrammarLimits") -> None:
    """GrammarError naming the first regular expression of `schema` nested past the bound."""
    for pattern, where in schema_patterns(schema):
        d = regex_depth(pattern)
        if d > limits.max_depth:
            raise GrammarError(f"{where}: groups nested {d} deep, over the limit of {limits.max_depth} "
                               "(--grammar-max-depth)")


def parse(text: str, limits: GrammarLimits = GrammarLimits()) -> Grammar:
    """The grammar's rules; GrammarError for a NUL, a grammar past a bound, or bad syntax."""
    if "\x00" in text:
        raise GrammarError(f"a NUL character at offset {text.index(chr(0))}: a grammar is text")
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > limits.max_bytes:
        raise GrammarError(f"{size} bytes, over the limit of {limits.max_bytes} (--grammar-max-bytes)")
    d = depth(text)
    if d > limits.max_depth:
        raise GrammarError(f"parentheses nested {d} deep, over the limit of {limits.max_depth} (--grammar-max-depth)")
    return _Parser(text).parse()


SHORT = 4  # an item none of whose nonempty matches is shorter than this many characters opens nothing
WIDE_WEIGHT = 2  # a wide item counts as this many: far more tokens continue through it


def width(g: Grammar, cap: int) -> int:
    """The most parse positions one place of `g` opens, each weighted by how many tokens can pass
    through it (at most cap + 1: past the cap the count stops). An item that may be empty and
    consumes few characters (a class, `.`, a short literal, a rule that can match that little)
    counts 1, a wide one WIDE_WEIGHT; an item whose every nonempty match is SHORT characters or
    longer counts nothing (a token rarely spans two of them: JSON's optional properties)."""
    big = SHORT + 1
    minlen = _fixpoint(g, lambda alts, get: min(sum(_minlen(it, get) for it in alt) for alt in alts), big, big)
    get_m = minlen.__getitem__
    short = _fixpoint(g, lambda alts, get: min(_short_seq(alt, get, get_m) for alt in alts), big, big)
    get_s = short.__getitem__
    nullable = {r: v == 0 for r, v in minlen.items()}
    get_n = nullable.__getitem__
    opened = _fixpoint(g, lambda alts, get: min(cap + 1, sum(_run(alt, 0, get, get_n, get_s, cap) for alt in alts)),
                       0, cap + 1)
    get_w = opened.__getitem__
    best = 0
    for alts in g.rules.values():
        for alt in alts:
            for j in range(len(alt)):
                best = max(best, _run(alt, j, get_w, get_n, get_s, cap))
                if best > cap:
                    return best
    return best


def left_recursive(g: Grammar) -> str | None:
    """A rule that references itself at a place no character has been read yet, or None."""
    nullable = _fixpoint(g, lambda alts, get: any(all(_nullable(it, get) for it in alt) for alt in alts), False,
                         False)
    leading: dict[str, set[str]] = {r: set() for r in g.rules}
    for r, alts in g.rules.items():
        for alt in alts:
            for it in alt:
                inner = it
                while inner.kind == "rep":
                    inner = inner.inner
                if inner.kind == "ref":
                    leading[r].add(inner.name)
                if not _nullable(it, nullable.__getitem__):
                    break
    state: dict[str, int] = {}  # 1: on the path, 2: done
    for start in g.rules:
        if state.get(start):
            continue
        path = [(start, iter(sorted(leading[start])))]
        state[start] = 1
        while path:
            r, nxt = path[-1]
            child = next(nxt, None)
            if child is None:
                state[r] = 2
                path.pop()
            elif state.get(child) == 1:
                return child
            elif not state.get(child) and child in leading:
                state[child] = 1
                path.append((child, iter(sorted(leading[child]))))
    return None


def _minlen(it: _Item, get) -> int:
    """The fewest characters the item matches (capped by the caller's fixpoint)."""
    if it.kind == "t":
        return min(it.size, SHORT + 1)
    if it.kind == "ref":
        return get(it.name)
    return 0 if it.hi == 0 else min(SHORT + 1, it.lo * _minlen(it.inner, get))


def _short(it: _Item, get_s, get_m) -> int:
    """The fewest characters of the item's shortest nonempty match (SHORT + 1: none shorter, or none)."""
    if it.kind == "t":
        return min(it.size, SHORT + 1)
    if it.kind == "ref":
        return get_s(it.name)
    if it.hi == 0:
        return SHORT + 1
    return min(SHORT + 1, max(_short(it.inner, get_s, get_m), it.lo * _minlen(it.inner, get_m)))


def _short_seq(alt: list[_Item], get_s, get_m) -> int:
    total = sum(_minlen(it, get_m) for it in alt)
    best = SHORT + 1
    for it in alt:
        best = min(best, total - _minlen(it, get_m) + _short(it, get_s, get_m))
    return min(best, SHORT + 1)


def _nullable(it: _Item, get_n) -> bool:
    if it.kind == "t":
        return False
    if it.kind == "ref":
        return get_n(it.name)
    return it.lo == 0 or it.hi == 0 or _nullable(it.inner, get_n)


def _opens(it: _Item, get_w, get_n, get_s, cap: int) -> int:
    """The weighted positions the item opens where it starts."""
    if it.kind == "t":
        return 0 if it.size > SHORT else WIDE_WEIGHT if it.wide else 1
    if it.kind == "ref":
        return 0 if get_s(it.name) > SHORT else max(1, get_w(it.name))
    if it.hi == 0:
        return 0
    inner = _opens(it.inner, get_w, get_n, get_s, cap)
    if not _nullable(it.inner, get_n):
        return inner
    # NOTE: every copy of an item that may be empty opens its positions at once; unbounded: no end
    return cap + 1 if it.hi is None and inner else min(cap + 1, inner * it.hi)


def _run(alt: list[_Item], j: int, get_w, get_n, get_s, cap: int) -> int:
    """Positions opened from item j of a sequence: its leading run of items that may be empty,
    and the first that may not."""
    total = 0
    for it in alt[j:]:
        total += _opens(it, get_w, get_n, get_s, cap)
        if total > cap or not _nullable(it, get_n):
            break
    return min(total, cap + 1)


def _fixpoint(g: Grammar, value, start, unknown):
    """Per rule, the fixed point of value(alternatives, get) reached from `start` (value is
    monotone and bounded), by a worklist: a rule is evaluated again only when a rule it
    references changed. `unknown` stands for a rule that is not defined."""
    users: dict[str, set[str]] = {r: set() for r in g.rules}
    for r, alts in g.rules.items():
        for alt in alts:
            for it in alt:
                while it.kind == "rep":
                    it = it.inner
                if it.kind == "ref" and it.name in users:
                    users[it.name].add(r)
    out = {r: start for r in g.rules}
    todo, queued = list(g.rules), set(g.rules)
    while todo:
        r = todo.pop()
        queued.discard(r)
        v = value(g.rules[r], lambda name: out.get(name, unknown))
        if v != out[r]:
            out[r] = v
            for u in users[r] - queued:
                todo.append(u)
                queued.add(u)
    return out


def check(text: str, limits: GrammarLimits = GrammarLimits()) -> None:
    """GrammarError unless `text` is GBNF within `limits` with a root (llama.cpp may still refuse
    it for a left recursion: its own one-line message)."""
    g = parse(text, limits)
    if "root" not in g.rules:
        raise GrammarError("no rule named root (the output starts at root ::= ...)")
    looped = left_recursive(g)
    if looped is not None:
        raise GrammarError(f"rule {looped!r} can reach itself before any character (a left recursion, which "
                           "llama.cpp refuses)")
    w = width(g, limits.max_width)
    if w > limits.max_width:
        raise GrammarError(f"a run of optional items opens more than {limits.max_width} parse positions at once, "
                           "and the sampler checks every token along each way they combine (--grammar-max-width; "
                           "nest them instead: x (x (x)?)? or x{0,n})")
