"""The installed package: typing marker and extension stub present, the stub in step with the extension,
test hooks outside the API."""

import ast
import os

import pytest

import gdnkit
from gdnkit import _gdnkit, _testing

PKG = os.path.dirname(gdnkit.__file__)


def stub_tree():
    with open(os.path.join(PKG, "_gdnkit.pyi"), encoding="utf-8") as f:
        return ast.parse(f.read())


def stub_functions():
    return {n.name: n for n in stub_tree().body if isinstance(n, ast.FunctionDef)}


def top_level_split(params):
    """Splits a parameter list at the commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in params:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def extension_params(fn):
    """(names before '*', names after '*') from nanobind's signature of fn."""
    sig = fn.__nb_signature__[0][0]
    inner = sig[sig.index("(") + 1:sig.rindex(") ->")]
    before, after, star = [], [], False
    for part in top_level_split(inner):
        if part == "*":
            star = True
            continue
        (after if star else before).append(part.split(":")[0].split("=")[0].strip())
    return before, after


def test_typing_files_installed():
    assert os.path.isfile(os.path.join(PKG, "py.typed"))
    assert os.path.isfile(os.path.join(PKG, "_gdnkit.pyi"))


def test_stub_declares_the_extension():
    declared = set(stub_functions())
    for node in stub_tree().body:
        if isinstance(node, ast.ClassDef):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    names = {n for n in dir(_gdnkit) if not n.startswith("__")}
    assert names == declared


@pytest.mark.parametrize("name", sorted(stub_functions()))
def test_stub_signatures(name):
    fn = getattr(_gdnkit, name)
    if not hasattr(fn, "__nb_signature__"):
        pytest.skip("this nanobind does not expose __nb_signature__")
    node = stub_functions()[name]
    stub = ([a.arg for a in node.args.posonlyargs + node.args.args], [a.arg for a in node.args.kwonlyargs])
    assert extension_params(fn) == stub


def test_exception_types_match_the_stub():
    for cls, base in [(gdnkit.GdnkitError, ValueError), (gdnkit.GdnkitNotImplementedError, NotImplementedError),
                      (gdnkit.GdnkitRuntimeError, RuntimeError)]:
        assert cls.__bases__ == (base,)


def test_test_hooks_outside_the_api():
    assert "_testing" not in gdnkit.__all__
    assert [n for n in dir(_gdnkit._testing) if not n.startswith("__")] == ["raise_error"]
    with pytest.raises(gdnkit.GdnkitError, match=r"^mode: expected 0, 1, 2 or 3, got 7$"):
        _testing.raise_error(7)
