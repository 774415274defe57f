"""Lesson scripts imported as modules, for the scripts that build on one (exercise solutions,
figure scripts): a lesson folder such as `02-fsdp` is not a package name, so a script is loaded
from its path. A lesson script's `main()` runs only when it is executed, so importing it gives
its functions and classes.

    from dtcourse import lessons
    transformer = lessons.load(Path(__file__).resolve().parents[1] / "fsdp_transformer.py")
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load(path: Path | str) -> ModuleType:
    """The script at `path` as a module, loaded once per process (under the name
    `lesson_<folder>_<file>`, registered so that pickling and dataclasses find it)."""
    path = Path(path).resolve()
    name = "lesson_" + "_".join(part.replace("-", "_") for part in (path.parent.name, path.stem))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
