"""A static check for code that works on gloo and breaks on NCCL.

The suite runs on CPUs with gloo, which takes tensors on any device. NCCL takes CUDA tensors only
("No backend type associated with device type cpu"), and a bare `.cuda()` or `torch.cuda.*` call
fails on a machine without a GPU. Neither shows on a CPU run, so this pass reads the source (the
`ast` of each script) and reports:

  cpu-tensor     a tensor made by a factory (torch.tensor, torch.zeros, ...) without `device=`,
                 or moved with `.cpu()`, reaches a collective (dist.all_reduce, ...) in the same
                 function: on NCCL the collective fails;
  gloo-only      a process group started with a literal "gloo" backend in a script that may run
                 on CUDA;
  bare-cuda      `.cuda()` anywhere, or a `torch.cuda.*` call outside a branch that tests for CUDA
                 (`if device.type == "cuda":`, `... if torch.cuda.is_available() else ...`, or
                 after an early `if ... != "cuda": return`).

A collective on a group that is meant to be gloo (its `group=` argument names gloo or cpu) and
scripts that refuse `--device cuda` (gloo-only by design: they say so with GLOO_ONLY) are exempt.
The check is deliberately narrow: what it reports is a bug on NCCL, not a matter of style.
"""

from __future__ import annotations

import ast
from pathlib import Path

COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "gather", "scatter", "batch_isend_irecv"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "linspace", "as_tensor", "from_numpy"}
# torch.cuda calls that are safe on any machine (they ask, they do not act)
CUDA_QUERIES = {"is_available", "device_count", "is_bf16_supported", "is_initialized"}


def _is_dist_call(node: ast.AST, names: set[str]) -> str | None:
    """'all_reduce' for dist.all_reduce(...) / torch.distributed.all_reduce(...)."""
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
    if func.attr == "cpu" and not value.args:
        return True
    if func.attr in FACTORIES and ast.unparse(func.value) == "torch":
        return not any(k.arg == "device" for k in value.keywords)
    return False


def _mentions_cuda(test: ast.AST) -> bool:
    return "cuda" in ast.unparse(test)


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
        cpu_names: dict[str, int] = {}
        for inner in ast.walk(node):
            if isinstance(inner, ast.Assign) and _makes_cpu_tensor(inner.value):
                for target in inner.targets:
                    if isinstance(target, ast.Name):
                        cpu_names[target.id] = inner.lineno
            op = _is_dist_call(inner, COLLECTIVES)
            if op is None:
                continue
            group = next((k.value for k in inner.keywords if k.arg == "group"), None)
            if group is not None and any(w in ast.unparse(group).lower() for w in ("gloo", "cpu")):
                continue
            for arg in inner.args[:2]:
                parts = arg.elts if isinstance(arg, (ast.List, ast.Tuple)) else [arg]
                for part in parts:
                    if _makes_cpu_tensor(part) or (isinstance(part, ast.Name)
                                                   and part.id in cpu_names
                                                   and cpu_names[part.id] < inner.lineno):
                        self.report(inner, "cpu-tensor", f"dist.{op}({ast.unparse(part)}) gets a "
                                    f"tensor made on the CPU (NCCL takes CUDA tensors only)")
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
        if isinstance(func, ast.Attribute) and func.attr == "cuda" and not node.args \
                and not self._guarded(node):
            self.report(node, "bare-cuda", f"{ast.unparse(node)}: use .to(device)")
        if isinstance(func, ast.Attribute) and ast.unparse(func.value) == "torch.cuda" \
                and func.attr not in CUDA_QUERIES and not self._guarded(node):
            self.report(node, "bare-cuda", f"{ast.unparse(func)}() outside a CUDA branch")
        self.generic_visit(node)

    def _guarded(self, node: ast.AST) -> bool:
        """Inside `if <cuda test>:` / `x if <cuda test> else y`, or after an early return on a
        CUDA test in the enclosing function."""
        for parent in reversed(self.stack):
            if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and _mentions_cuda(parent.test):
                return True
            if isinstance(parent, ast.BoolOp) and any(_mentions_cuda(v) for v in parent.values):
                return True
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for stmt in parent.body:
                    if stmt.lineno >= node.lineno:
                        break
                    if isinstance(stmt, ast.If) and _mentions_cuda(stmt.test) and any(
                            isinstance(s, ast.Return) for s in stmt.body):
                        return True
                return False
        return False


def check_source(source: str, path: str = "<source>") -> list[str]:
    """Findings for one file's source, each 'path:line: kind: what'."""
    tree = ast.parse(source)
    if any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "GLOO_ONLY"
                                             for t in n.targets) for n in tree.body):
        return []  # refuses --device cuda by design (receive-from-any-source and the like)
    checker = _Checker(path)
    checker.visit(tree)
    return checker.findings


def check_files(paths, root: Path) -> list[str]:
    return [f for p in paths for f in check_source(Path(p).read_text(),
                                                   str(Path(p).relative_to(root)))]
