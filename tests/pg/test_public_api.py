"""``mooncake_pg``'s public surface: one ``__all__``, every public function annotated, and
the extension loaded in one place."""

import inspect
import pathlib
import re

import mooncake_pg
from tests import REPO_ROOT


def test_all_names_exist_once():
    names = mooncake_pg.__all__
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    missing = [n for n in names if not hasattr(mooncake_pg, n)]
    assert not missing, missing


def test_public_functions_fully_annotated():
    """Every parameter and the return of each public function carries a type annotation
    and the function has a docstring."""
    bare = []
    for name in mooncake_pg.__all__:
        obj = getattr(mooncake_pg, name)
        if not inspect.isfunction(obj):
            continue
        sig = inspect.signature(obj)
        for p in sig.parameters.values():
            if p.annotation is inspect.Parameter.empty:
                bare.append(f"{name}({p.name})")
        if sig.return_annotation is inspect.Signature.empty:
            bare.append(f"{name} -> ?")
        if not (obj.__doc__ or "").strip():
            bare.append(f"{name}: no docstring")
    assert not bare, bare


def test_extension_loaded_in_one_place():
    """Only ``mooncake_pg/_loader.py`` imports ``mooncake_pg._C`` itself (after its torch
    version check); the rest of the project takes it from there or from the package."""
    pattern = re.compile(
        r"import_module\(\s*[\"']mooncake_pg\._C|^\s*from \. import _C\b|^\s*import mooncake_pg\._C",
        re.M,
    )
    offenders = []
    root = pathlib.Path(REPO_ROOT)
    for folder in ("mooncake_pg", "mooncake_ep", "store"):
        for path in (root / folder).rglob("*.py"):
            if path.name == "_loader.py" and path.parent.name == "mooncake_pg":
                continue
            if pattern.search(path.read_text()):
                offenders.append(str(path.relative_to(root)))
    assert not offenders, offenders
