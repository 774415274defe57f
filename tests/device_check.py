"""A static check for code that works on a CPU with gloo and breaks on a GPU machine.

The suite runs on CPUs with gloo, which takes tensors on any device. A process group started with
backend "nccl" (what dtcourse.launch.setup does on CUDA) takes CUDA tensors only ("No backend type
associated with device type cpu"; a group started as "cpu:gloo,cuda:nccl" would route CPU tensors
to gloo instead), and a CUDA call fails where no GPU exists. Neither shows on a CPU run, so this
pass reads the source (the `ast` of each script) and reports:

  cpu-tensor     a tensor made by a factory (torch.tensor, torch.zeros, ...) without `device=`,
                 or moved with `.cpu()`, reaches a collective (dist.all_reduce, ...) in the same
                 function with no reassignment in between: on NCCL the collective fails;
  gloo-only      a process group started with a literal "gloo" backend in a script that may run
                 on CUDA;
  nccl-op        what gloo offers and NCCL refuses: a recv() without src (receive from any
                 source), ReduceOp.BAND / BOR / BXOR;
  bare-cuda      `.cuda(...)` or a `torch.cuda.*` call outside the branch that has tested for
                 CUDA (`if device.type == "cuda":`, its `else` of a `!=` test, `x if cuda else y`,
                 or after an early `if ... != "cuda": return`): it fails on a machine without a
                 GPU (the calls that are safe there, like manual_seed or is_available, aside);
  offload-group  FSDP CPU offload (FSDP2's CPUOffloadPolicy(...), FSDP1's
                 CPUOffload(offload_params=...)) in a script whose process group is NCCL-only on
                 CUDA: a dtcourse setup(...) / distributed(...) without cpu_collectives, or
                 init_process_group("nccl"). The offloaded gradient shards are CPU tensors and
                 clip_grad_norm_ all-reduces their norms there: on NCCL alone the first step
                 fails (pytorch#148532); "cpu:gloo,cuda:nccl" (cpu_collectives=...) routes them
                 to gloo.

  raw-clock      a host wall clock (time.perf_counter, time.time, time.monotonic and their _ns
                 forms) read in a script that may run on CUDA. On CUDA kernels and NCCL
                 collectives are queued and the call returns at once, so a host timestamp around
                 them measures how long the host took to queue the work; on a CPU with gloo the
                 two are the same, so no CPU run shows it. The scripts time through
                 dtcourse.timing (clock(device) drains the device's queue first; stamp(device)
                 is a CUDA event on CUDA). A line that means the host's own time (a data
                 loader's wait, a hang's wall time, a deadline) says so with a comment
                 `# host clock: <why>` on the statement.

A collective on a group meant to be gloo (an argument that names gloo or cpu) and scripts that
refuse CUDA by design (they say why in GLOO_ONLY) are exempt. What no reading of the source can
decide stays out: sizes that differ across ranks, and a CPU tensor that reaches a collective from
another function or an attribute. The one such tensor the course shipped, FSDP's CPU-offloaded
gradient shards all-reduced by clip_grad_norm_, is what offload-group guards; and a script that
does keep such tensors starts its group as "cpu:gloo,cuda:nccl" (dtcourse.launch's
cpu_collectives), which routes CPU tensors to gloo instead of failing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "gather", "scatter", "batch_isend_irecv"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "linspace", "as_tensor", "from_numpy"}
# torch.cuda calls that are safe on a machine without a GPU (they ask, or do nothing there)
CUDA_SAFE = {"is_available", "device_count", "is_bf16_supported", "is_initialized", "manual_seed",
             "manual_seed_all", "empty_cache", "memory_stats", "memory_allocated",
             "max_memory_allocated"}
NCCL_REFUSES = {"BAND", "BOR", "BXOR"}


# collectives imported by name (from torch.distributed import all_reduce): set per module
_IMPORTED_COLLECTIVES: set[str] = set()


def _is_dist_call(node: ast.AST, names: set[str]) -> str | None:
    """'all_reduce' for dist.all_reduce(...) / torch.distributed.all_reduce(...) / all_reduce(...)
    imported from torch.distributed."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in names and node.func.id in _IMPORTED_COLLECTIVES:
        return node.func.id
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in names:
        base = ast.unparse(node.func.value)
        if base in ("dist", "torch.distributed"):
            return node.func.attr
    return None


def _makes_cpu_tensor(value: ast.AST) -> bool:
    """torch.<factory>(...) without device=, or <x>.cpu()."""
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
        return False
    func = value.func

    def names_cpu(arg: ast.AST) -> bool:  # "cpu", torch.device("cpu")
        return "'cpu'" in ast.unparse(arg) or '"cpu"' in ast.unparse(arg)
    if func.attr == "cpu" and not value.args:
        return True
    if func.attr == "to" and (any(names_cpu(a) for a in value.args[:1]) or any(
            k.arg == "device" and names_cpu(k.value) for k in value.keywords)):
        return True
    if func.attr in FACTORIES and ast.unparse(func.value) == "torch":
        device = next((k.value for k in value.keywords if k.arg == "device"), None)
        return device is None or names_cpu(device)
    return False


def _cuda_sense(test: ast.AST) -> bool | None:
    """True if the test holds only on CUDA (== "cuda", != "cpu", is_available()), False if it
    holds whenever CUDA is off (!= "cuda", == "cpu", not ..., device_count() == 0), None if it
    does not decide (no mention of CUDA; `on CUDA or X` may hold off CUDA, and `off CUDA and X`
    may fail off CUDA)."""
    text = ast.unparse(test)
    if re.search(r"""==\s*['"]cpu['"]""", text) or re.search(
            r"device_count\(\)\s*(==\s*0|<\s*1)", text):
        sense = False
    elif re.search(r"""!=\s*['"]cpu['"]""", text):
        sense = True
    elif "cuda" not in text:
        return None
    else:
        sense = not ("!=" in text or text.startswith("not ") or " not in " in text)
    if (sense and " or " in text) or (not sense and " and " in text):
        return None
    return sense


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path, self.findings = path, []
        self.stack: list[ast.AST] = []  # enclosing nodes

    def report(self, node: ast.AST, kind: str, what: str) -> None:
        self.findings.append(f"{self.path}:{node.lineno}: {kind}: {what}")

    def generic_visit(self, node):
        self.stack.append(node)
        super().generic_visit(node)
        self.stack.pop()

    # -- cpu-tensor: per function, names bound to CPU-made tensors that reach a collective -------
    def visit_FunctionDef(self, node):
        bound: list[tuple[int, str, bool]] = []  # (line, name, made on the CPU?)
        for inner in ast.walk(node):
            if isinstance(inner, ast.Assign):
                for target in inner.targets:
                    if isinstance(target, ast.Name):
                        bound.append((inner.lineno, target.id, _makes_cpu_tensor(inner.value)))
        bound.sort()

        def cpu_made(name: str, line: int) -> bool:
            last = [cpu for at, n, cpu in bound if n == name and at < line]
            return bool(last) and last[-1]

        for inner in ast.walk(node):
            op = _is_dist_call(inner, COLLECTIVES)
            if op is None:
                continue
            # the group: a positional argument after the tensors (all_reduce(t, op, group),
            # all_gather(out, t, group), ...) or group=; not the tensors themselves
            rest = inner.args[2:] + [k.value for k in inner.keywords if k.arg == "group"]
            if any(w in ast.unparse(a).lower() for a in rest for w in ("gloo", "cpu")):
                continue  # a group meant to be gloo
            for arg in inner.args[:2]:
                parts = arg.elts if isinstance(arg, (ast.List, ast.Tuple)) else [arg]
                for part in parts:
                    if _makes_cpu_tensor(part) or (isinstance(part, ast.Name)
                                                   and cpu_made(part.id, inner.lineno)):
                        self.report(inner, "cpu-tensor", f"dist.{op}({ast.unparse(part)}) gets a "
                                    f"tensor made on the CPU (NCCL takes CUDA tensors only)")
            if op in ("recv", "irecv") and len(inner.args) < 2 and not any(
                    k.arg == "src" for k in inner.keywords):
                self.report(inner, "nccl-op", f"{op}() without src: receive from any source is "
                            "gloo's, NCCL has none")
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    # -- gloo-only and bare-cuda ------------------------------------------------------------------
    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "init_process_group":
            backend = node.args[0] if node.args else next(
                (k.value for k in node.keywords if k.arg == "backend"), None)
            if isinstance(backend, ast.Constant) and backend.value == "gloo":
                self.report(node, "gloo-only", "init_process_group('gloo') in a script that "
                            "may run on CUDA: choose nccl there (dtcourse.launch.setup does)")
        if isinstance(func, ast.Attribute) and func.attr == "cuda" \
                and ast.unparse(func.value) != "torch" and not self._guarded(node):
            self.report(node, "bare-cuda", f"{ast.unparse(node)}: use .to(device)")
        if isinstance(func, ast.Attribute) and ast.unparse(func.value) == "torch.cuda" \
                and func.attr not in CUDA_SAFE and not self._guarded(node):
            self.report(node, "bare-cuda", f"{ast.unparse(func)}() outside a CUDA branch")
        self.generic_visit(node)

    def visit_Attribute(self, node):
        if node.attr in NCCL_REFUSES and ast.unparse(node.value).endswith("ReduceOp"):
            self.report(node, "nccl-op", f"{ast.unparse(node)}: NCCL has no bitwise reductions")
        self.generic_visit(node)

    def _guarded(self, node: ast.AST) -> bool:
        """In the branch that runs on CUDA: the body of `if <on CUDA>`, the else of `if <off
        CUDA>` (the same for `x if ... else y` and `... and ...`), or after an early
        `if <off CUDA>: return` in the enclosing function."""
        child = node
        for parent in reversed(self.stack):
            if isinstance(parent, (ast.If, ast.IfExp, ast.While)):
                sense = _cuda_sense(parent.test)
                in_body = child in (parent.body if isinstance(parent.body, list)
                                    else [parent.body])
                in_else = child in (parent.orelse if isinstance(parent.orelse, list)
                                    else [parent.orelse])
                if (sense is True and in_body) or (sense is False and in_else):
                    return True
            if isinstance(parent, ast.BoolOp) and isinstance(parent.op, ast.And) and any(
                    _cuda_sense(v) for v in parent.values if v is not child):
                return True
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for stmt in parent.body:
                    if stmt.lineno >= node.lineno:
                        break
                    if isinstance(stmt, ast.If) and _cuda_sense(stmt.test) is False and any(
                            isinstance(s, (ast.Return, ast.Raise)) for s in stmt.body):
                        return True
                return False
            child = parent
        return False


def _offload_group(tree: ast.AST, path: str) -> list[str]:
    """offload-group: the module offloads FSDP state to the CPU and starts a group that has no
    CPU backend on CUDA."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]

    def name(call: ast.Call) -> str:
        return ast.unparse(call.func).rsplit(".", 1)[-1]

    def offloads(call: ast.Call) -> bool:
        if name(call) == "CPUOffloadPolicy":
            return True
        if name(call) == "CPUOffload":
            arg = call.args[0] if call.args else next(
                (k.value for k in call.keywords if k.arg == "offload_params"), None)
            return arg is not None and not (isinstance(arg, ast.Constant) and not arg.value)
        return False

    if not any(offloads(c) for c in calls):
        return []
    found = []
    for call in calls:
        if name(call) in ("setup", "distributed") and (
                ast.unparse(call.func) in ("setup", "distributed")
                or ast.unparse(call.func).endswith(("launch.setup", "launch.distributed"))):
            if len(call.args) < 3 and not any(k.arg == "cpu_collectives"
                                              for k in call.keywords):
                found.append(f"{path}:{call.lineno}: offload-group: {ast.unparse(call.func)}() "
                             "without cpu_collectives in a script that offloads to the CPU: "
                             "on CUDA an NCCL-only group cannot all-reduce the offloaded "
                             "gradients (pass cpu_collectives=args.cpu_offload)")
        if name(call) == "init_process_group":
            backend = call.args[0] if call.args else next(
                (k.value for k in call.keywords if k.arg == "backend"), None)
            if isinstance(backend, ast.Constant) and backend.value == "nccl":
                found.append(f"{path}:{call.lineno}: offload-group: init_process_group('nccl') "
                             "in a script that offloads to the CPU: use 'cpu:gloo,cuda:nccl'")
    return found


HOST_CLOCKS = {"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns"}
HOST_CLOCK_NOTE = "# host clock:"


def _raw_clock(tree: ast.AST, source: str, path: str) -> list[str]:
    """raw-clock: a host wall clock read without `# host clock: <why>` on its statement."""
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names if n.module == "time" and a.name in HOST_CLOCKS
                or n.module == "timeit" and a.name == "default_timer"}
    modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names if a.name == "time"}
    lines = source.splitlines()
    # the simple statements' line spans: a comment anywhere on the statement exempts its clocks
    spans = sorted(((n.lineno, n.end_lineno) for n in ast.walk(tree)
                    if isinstance(n, ast.stmt) and not hasattr(n, "body")),
                   key=lambda span: span[1] - span[0])
    found = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        named = (isinstance(func, ast.Attribute) and func.attr in HOST_CLOCKS
                 and ast.unparse(func.value) in modules | {"time"}) or (
                     isinstance(func, ast.Attribute) and ast.unparse(func) == "timeit.default_timer"
                 ) or (isinstance(func, ast.Name) and func.id in imported)
        if not named:
            continue
        first, last = next(((a, b) for a, b in spans if a <= call.lineno <= b),
                           (call.lineno, call.end_lineno))
        if any(HOST_CLOCK_NOTE in line for line in lines[first - 1:last]):
            continue
        found.append(f"{path}:{call.lineno}: raw-clock: {ast.unparse(func)}() in a script that "
                     "may run on CUDA measures when the host queued the work: time with "
                     "dtcourse.timing.clock(device), or say `# host clock: <why>` on the line")
    return found


def check_source(source: str, path: str = "<source>") -> list[str]:
    """Findings for one file's source, each 'path:line: kind: what'."""
    tree = ast.parse(source)
    _IMPORTED_COLLECTIVES.clear()
    _IMPORTED_COLLECTIVES.update(
        a.asname or a.name for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "torch.distributed"
        for a in n.names if a.name in COLLECTIVES)
    if any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "GLOO_ONLY"
                                             for t in n.targets) for n in tree.body):
        return []  # refuses --device cuda by design (receive-from-any-source and the like)
    checker = _Checker(path)
    checker.visit(tree)
    checker.findings += _offload_group(tree, path) + _raw_clock(tree, source, path)
    return list(dict.fromkeys(checker.findings))  # a nested function is walked twice


def check_files(paths, root: Path) -> list[str]:
    return [f for p in paths for f in check_source(Path(p).read_text(),
                                                   str(Path(p).relative_to(root)))]
