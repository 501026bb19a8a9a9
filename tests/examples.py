"""The example scripts as modules, for tests that run their functions (examples/ is no package)."""

import importlib.util
import pathlib


def load_example(name: str):
    """``examples/<name>.py`` imported as a module of that name."""
    path = pathlib.Path(__file__).parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
