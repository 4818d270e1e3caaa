"""The house keeps its floors: no module of the repository imports, even inside a function, one
that imports it back (a circle makes the import order matter and the layers meaningless)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def repository_imports():
    """{module: the repository's top-level modules it imports anywhere in its file}."""
    modules = {p.stem for p in ROOT.glob('*.py')}
    graph = {}
    for name in modules:
        tree = ast.parse((ROOT / f'{name}.py').read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name.split('.')[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split('.')[0])
        graph[name] = sorted((found & modules) - {name})
    return graph


def test_the_repositorys_modules_import_each_other_without_a_circle():
    graph = repository_imports()
    assert {'model', 'baselines', 'norms'} <= graph.keys() and 'baselines' in graph['model']
    done, path = set(), []

    def visit(name):  # depth-first: a module met again on the current path closes a circle
        assert name not in path, f"import circle: {' -> '.join(path[path.index(name):] + [name])}"
        if name not in done:
            path.append(name)
            for dep in graph[name]:
                visit(dep)
            path.pop()
            done.add(name)

    for name in sorted(graph):
        visit(name)
