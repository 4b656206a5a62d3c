"""Each package's ``__init__`` docstring is its index: it names every module and sub-package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ppokit

PACKAGE = Path(ppokit.__file__).resolve().parent
# packages whose docstring states their purpose without listing modules (a handful of modules each,
# each with a name that says what it is): the top-level package, whose README section is the index
UNLISTED = {"ppokit"}


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def children(package: Path) -> set[str]:
    """The modules and sub-packages directly inside ``package``."""
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    subpackages = {p.parent.name for p in package.glob("*/__init__.py")}
    return modules | subpackages


def dotted_name(package: Path) -> str:
    return ".".join(package.relative_to(PACKAGE.parent).parts)


def listed(package: Path, dotted: str) -> set[str]:
    """The names ``package``'s docstring refers to as ``:mod:`.name``` (or ``.name.sub``) or
    ``:mod:`dotted.name```."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    names = set()
    for ref in re.findall(r":mod:`~?([\w.]+)`", doc):
        if ref.startswith("."):
            names.add(ref[1:].split(".")[0])
        elif ref.startswith(dotted + "."):
            names.add(ref[len(dotted) + 1 :].split(".")[0])
    return names


def test_every_package_docstring_lists_its_modules():
    missing = {}
    for package in packages():
        name = dotted_name(package)
        if name in UNLISTED:
            continue
        absent = children(package) - listed(package, name)
        if absent:
            missing[name] = sorted(absent)
    assert missing == {}, f"modules missing from their package's docstring: {missing}"


def test_the_index_check_sees_a_missing_module(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""Index.\n\n- :mod:`.a`  one\n- :mod:`pkg.c.d`  three\n"""\n')
    for module in ("a.py", "b.py", "c.py"):
        (package / module).write_text("")
    assert listed(package, "pkg") == {"a", "c"}
    assert children(package) - listed(package, "pkg") == {"b"}
