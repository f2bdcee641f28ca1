"""The product's tree measured from its source (``ast``, never imported): what tests/unit/test_architecture.py
holds it to, and a report of the same numbers (``.venv/bin/python tests/support/tree.py``), the evidence
a restructuring shows before and after."""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Product directories and the package each one is, as pyproject.toml maps them.
PACKAGES = {
    directory: package
    for package, directory in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].items()
}
#: Who may use shared/: each of these counts as one user.
USERS = ("ingest", "dispatcher", "health_monitor", "outbox_relay", "cli")
#: Each service's wiring module: what its process is made of.
WIRING = {
    "ingest": "services/ingest/service.py",
    "dispatcher": "services/dispatcher/service.py",
    "health-monitor": "services/health-monitor/service.py",
    "outbox-relay": "services/outbox-relay/service.py",
}


def product_modules() -> Iterator[Path]:
    for directory in PACKAGES:
        yield from sorted((ROOT / directory).rglob("*.py"))


def module_name(path: Path) -> str:
    for directory, package in PACKAGES.items():
        if path.is_relative_to(ROOT / directory):
            parts = path.relative_to(ROOT / directory).with_suffix("").parts
            return ".".join((package, *parts)).removesuffix(".__init__")
    raise AssertionError(path)


def imported(path: Path) -> set[str]:
    """The hookline modules a module imports (``from a import b`` counts ``a.b`` when that is a module)."""
    known = {module_name(p) for p in product_modules()}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hookline"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("hookline")}
    return found


def classes() -> Iterator[tuple[str, int, int]]:
    """(where, lines, methods) of every class in the product."""
    for path in product_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body)
                where = f"{path.relative_to(ROOT)}:{node.name}"
                yield where, node.end_lineno - node.lineno + 1, methods


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines())


def report() -> str:
    """Lines per top-level concept, the largest classes and modules, each wiring module's imports, and
    the tests at each level."""
    out = ["lines per concept:"]
    concepts = [
        *sorted(p.parent for p in (ROOT / "shared").glob("*/__init__.py")),
        *(ROOT / d for d in PACKAGES),
    ]
    for concept in concepts:
        if concept == ROOT / "shared":
            continue
        total = sum(lines_of(p) for p in concept.rglob("*.py"))
        out.append(f"  {concept.relative_to(ROOT)}/: {total}")
    out.append("largest classes (lines, methods):")
    for where, lines, methods in sorted(classes(), key=lambda c: -c[1])[:8]:
        out.append(f"  {lines:4} {methods:3}  {where}")
    out.append("largest modules (lines):")
    for path in sorted(product_modules(), key=lines_of, reverse=True)[:8]:
        out.append(f"  {lines_of(path):4}  {path.relative_to(ROOT)}")
    out.append("hookline modules each wiring module imports:")
    for service, wiring in WIRING.items():
        out.append(f"  {service}: {len(imported(ROOT / wiring))}")
    out.append("tests (modules, functions):")
    for level in ("unit", "integration", "e2e"):
        modules = sorted((ROOT / "tests" / level).glob("test_*.py"))
        functions = sum(
            isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
            for m in modules
            for n in ast.walk(ast.parse(m.read_text()))
        )
        out.append(f"  {level}: {len(modules)} modules, {functions} test functions")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(report() + "\n")
