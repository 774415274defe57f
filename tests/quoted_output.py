"""The outputs the READMEs quote, re-checked against a fresh run of their command.

Convention (every Markdown file of the repository):
  a ```text (or ```console) block that follows a ```bash block with nothing but blank lines between
  is the output of that block's one command. The suite runs the command (see
  conftest.run_readme_command) and checks every quoted line against the fresh output:

  - the line must appear in the output with the same words (numbers aside);
  - every number must match the fresh one: an integer (a count, bytes) exactly; a decimal to one
    unit in its last digit or 0.5% of its value, whichever is larger. Other CPUs pick other
    kernels, which round differently: a loss's last digit can go either way, and after two epochs
    an accuracy measured on this machine as 98.73% came out 98.83% with
    ATEN_CPU_CAPABILITY=default (one test image in a thousand). A stale quote, from other code or
    other flags, is off by far more;
  - numbers that depend on the machine's speed are not compared. The scripts mark them: a number
    followed by a unit of time or rate (s, ms, us, GB/s, samples/s, tokens/s, ...), or written with
    a leading `~` (a timing in a table, a share of time, a count that depends on scheduling);
  - a line `...` stands for lines left out;
  - a rounding-level figure must carry `~`: a decimal (not a count) in a line that prints a
    tolerance ("tolerance 0.0001", "tol=1e-05", "< 1e-05") and below it, or, in a line about a
    difference ("diff", "difference", "max |a - b|", "error"), after those words and below
    DIFF_TOLERANCE (the float32 tolerance the equivalence tests use); a zero is exact. Such a
    figure is float32 rounding: its digits depend on the CPU's kernels (03-deepspeed quoted a
    logit difference 2.86e-06 that another CPU printed as 3.81e-06), so it is refused unmarked
    on every machine, before any run, and not compared once marked;
  - `rel=X` after the block's language (```text rel=0.02) widens the 0.5% to X for that quote: a
    run whose trajectory rounding changes visibly (a convnet trained for two epochs) says so.

Timestamps of library log lines and memory addresses are not numbers of the lesson: lines that
carry them are not quoted (the check refuses them, so that no quote depends on the date).
"""

import re
from pathlib import Path

NUMBER = re.compile(r"(~?)(?<![\w.])(-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?)")
TIMED = re.compile(r"\s?(?:ns|us|µs|ms|s|sec|min|h|GB/s|MB/s|KB/s|GiB/s|MiB/s|Gb/s|samples/s|"
                   r"tokens/s|tok/s|it/s|steps/s|TFLOP/s|TFLOPS|GFLOP/s|ms/step|s/step|s/it)"
                   r"(?![\w/])")
# a rounding-level figure (see the module's docstring) must be written with a leading ~
DIFF_TOLERANCE = 1e-4
DIFF_CONTEXT = re.compile(r"diff|difference|error|max\s*\|[^|]*-[^|]*\|", re.I)
TOLERANCE_AT = re.compile(r"(?:tolerance|tol|atol|rtol)\s*[=:]?\s*|<=?\s*|≤\s*", re.I)
FORBIDDEN = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d|0x[0-9a-f]{6,}")


def code_blocks(text: str) -> list[tuple[int, int, str, str, str]]:
    """(start, end, info word, body, rest of the info line) of every fenced block."""
    return [(m.start(), m.end(), m.group(1), m.group(3), m.group(2))
            for m in re.finditer(r"^```(\w*)([^\n]*)\n(.*?)^```", text, flags=re.S | re.M)]


def block_commands(body: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", "", body)
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def quoted_outputs(docs) -> list[dict]:
    """Every (command, quoted output) pair of the documents, with where it is."""
    pairs = []
    for doc in docs:
        text = Path(doc).read_text()
        blocks = code_blocks(text)
        for prev, block in zip(blocks, blocks[1:]):
            if prev[2] == "bash" and block[2] in ("text", "console") \
                    and not text[prev[1]:block[0]].strip():
                rel = re.search(r"\brel=([\d.]+)", block[4])
                pairs.append({"doc": Path(doc), "line": text[:block[0]].count("\n") + 1,
                              "commands": block_commands(prev[3]), "quote": block[3],
                              "rel": float(rel.group(1)) if rel else 0.005})
    return pairs


def shape(line: str) -> str:
    """The words of a line, numbers replaced, spacing normalised (tables are re-aligned freely)."""
    return " ".join(NUMBER.sub("#", line.replace("~", "")).split())


def numbers(line: str) -> list[tuple[str, bool]]:
    """(number as printed, compared?) for every number of a line, in order."""
    out = []
    for m in NUMBER.finditer(line):
        timed = bool(m.group(1)) or bool(TIMED.match(line, m.end()))
        out.append((m.group(2), not timed))
    return out


def unmarked_rounding(line: str) -> list[str]:
    """The figures of a quoted line that are rounding-level and carry no `~`."""
    found = [(m.start(2), m.group(2), bool(m.group(1))) for m in NUMBER.finditer(line)]
    tolerance_at = {m.end() for m in TOLERANCE_AT.finditer(line)}
    tolerances = [value(p) for at, p, _ in found if at in tolerance_at]
    limit = max(tolerances, default=None)
    diff = DIFF_CONTEXT.search(line)
    bad = []
    for at, printed, marked in found:
        is_decimal = "." in printed or "e" in printed.lower()
        if marked or at in tolerance_at or not is_decimal or value(printed) == 0 \
                or TIMED.match(line, at + len(printed)):
            continue  # a zero is exact (and compared to its last digit, which covers rounding)
        if (limit is not None and abs(value(printed)) < limit) or (
                diff and at > diff.start() and abs(value(printed)) < DIFF_TOLERANCE):
            bad.append(printed)
    return bad


def value(printed: str) -> float:
    return float(printed.replace(",", ""))


def last_digit(printed: str) -> float:
    """One unit in the last printed digit (of the mantissa, for 1.5e-07); 0 for an integer."""
    mantissa, _, exponent = printed.replace(",", "").lower().partition("e")
    if "." not in mantissa and not exponent:
        return 0.0
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (-decimals + (int(exponent) if exponent else 0))


def same_numbers(quoted: str, fresh: str, rel: float = 0.005) -> str | None:
    """None if every compared number of the quoted line matches the fresh line, else why not."""
    q, f = numbers(quoted), numbers(fresh)
    if len(q) != len(f):
        return f"{len(q)} numbers quoted, {len(f)} printed"
    for (qs, compared), (fs, _) in zip(q, f):
        step = last_digit(qs)
        tolerance = 0.0 if step == 0 else max(1.001 * step, rel * abs(value(qs)))
        if compared and abs(value(qs) - value(fs)) > tolerance:
            return f"quoted {qs}, printed {fs}"
    return None


def check(quote: str, output: str, rel: float = 0.005) -> list[str]:
    """Problems with a quoted output against a fresh one (empty when it holds)."""
    fresh = [line for line in output.splitlines() if line.strip()]
    used, problems = set(), []
    for line in quote.splitlines():
        if not line.strip() or line.strip() in ("...", "…"):
            continue
        if FORBIDDEN.search(line):
            problems.append(f"quotes a timestamp or an address, which no run reproduces: {line!r}")
            continue
        if unmarked_rounding(line):
            problems.append(f"rounding-level figures {unmarked_rounding(line)} quoted without "
                            f"~ (their digits depend on the CPU): {line!r}")
            continue
        candidates = [i for i, out in enumerate(fresh)
                      if i not in used and shape(out) == shape(line)]
        if not candidates:
            problems.append(f"not in the output: {line!r}")
            continue
        why = {i: same_numbers(line, fresh[i], rel) for i in candidates}
        match = next((i for i in candidates if why[i] is None), None)
        if match is None:  # report the printed line that agrees on the most numbers
            i = max(candidates, key=lambda i: sum(a == b for a, b in zip(
                numbers(line), numbers(fresh[i]))))
            problems.append(f"{why[i]}:\n    quoted:  {line!r}\n    printed: {fresh[i]!r}")
            continue
        used.add(match)
    return problems
