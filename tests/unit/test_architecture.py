"""The tree as the architecture: read from the source (``ast``), never run. Each rule here was a finding
of a review (issue 27); a test fails when the tree drifts back."""

from __future__ import annotations

import ast
import re

import pytest
from support.tree import ROOT, USERS, WIRING, classes, imported, module_name, product_modules

MAX_CLASS_LINES = 250
MAX_CLASS_METHODS = 15
MAX_WIRING_IMPORTS = 15


def test_no_class_is_a_god_object() -> None:
    too_big = [
        f"{where}: {lines} lines, {methods} methods"
        for where, lines, methods in classes()
        if lines > MAX_CLASS_LINES or methods > MAX_CLASS_METHODS
    ]
    assert not too_big, (
        f"split by responsibility (at most {MAX_CLASS_LINES} lines, {MAX_CLASS_METHODS} methods)"
    )


@pytest.mark.parametrize("service", ["ingest", "dispatcher"])
def test_a_services_wiring_imports_few_modules(service: str) -> None:
    found = imported(ROOT / WIRING[service])
    assert len(found) < MAX_WIRING_IMPORTS, sorted(found)


def test_shared_holds_only_what_two_users_share() -> None:
    """A module of shared/ used by one service alone belongs in that service (what shared/ modules use
    counts for each of their users)."""
    shared = {module_name(p): p for p in (ROOT / "shared").rglob("*.py") if p.name != "__init__.py"}
    users: dict[str, set[str]] = {name: set() for name in shared}
    for path in product_modules():
        owner = module_name(path).split(".")[1]
        if owner in USERS:
            for name in imported(path) & set(shared):
                users[name].add(owner)
    # What a shared module uses is used by that module's users too, however deep.
    changed = True
    while changed:
        changed = False
        for name, path in shared.items():
            for used in imported(path) & set(shared):
                if not users[name] <= users[used]:
                    users[used] |= users[name]
                    changed = True
    alone = {name: sorted(who) for name, who in users.items() if len(who) < 2}
    assert not alone, f"used by one service (or none): move into it {alone}"


def test_shared_is_split_by_concept_and_each_part_says_what_it_owns() -> None:
    assert not [p.name for p in (ROOT / "shared").glob("*.py") if p.name != "__init__.py"], (
        "a module of shared/ belongs in one of its concepts"
    )
    for package in sorted(p.parent for p in (ROOT / "shared").glob("*/__init__.py")):
        docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert docstring, f"{package.relative_to(ROOT)} says what it owns"


def test_each_module_name_says_one_thing() -> None:
    """No two product modules share a name (``status`` meaning two things), but for what each service
    has one of by design."""
    by_design = {"__init__", "__main__", "service", "settings", "metrics"}
    seen: dict[str, list[str]] = {}
    for path in product_modules():
        seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1 and name not in by_design}
    assert not twice


def layout() -> dict[str, str]:
    """The README's layout block: each top-level entry (``services/ingest/``) and the text under it."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Layout\n.*?^```\n(.*?)\n```", text, re.S | re.M)
    assert block is not None, "README.md has a Layout section with the tree"
    sections: dict[str, str] = {}
    current = ""
    for line in block.group(1).splitlines():
        if line and not line[0].isspace():
            current, _, line = line.partition(" ")
            sections[current] = ""
        sections[current] += " " + line.strip()
    return sections


def test_the_readme_layout_names_every_product_module() -> None:
    sections = layout()
    missing = []
    for path in product_modules():
        if path.name in ("__init__.py", "__main__.py"):
            continue
        directory = f"{path.parent.relative_to(ROOT)}/"
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}\b", sections.get(directory, "")):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, "README.md's Layout names each module under its directory"
