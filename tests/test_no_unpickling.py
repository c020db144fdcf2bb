"""No file the package reads is unpickled: every ``torch.load`` passes ``weights_only=True`` (torch
before 2.6 unpickles by default, and ``pyproject.toml`` allows torch 2.4), and nothing imports
pickle or its relatives, or asks numpy to unpickle."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

PACKAGE = Path(__file__).resolve().parent.parent / "specserve"
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _is_true(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _call_name(call: ast.Call) -> str:
    """'torch.load' for torch.load(...), 'load' for load(...), '' for anything else."""
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f"{f.value.id}.{f.attr}"
    return f.id if isinstance(f, ast.Name) else ""


def unsafe_loads(source: str, filename: str = "<src>") -> list[str]:
    """Lines of ``source`` that could unpickle: torch.load without weights_only=True (also under
    another name: ``from torch import load``, ``import torch as t``), pickle-family imports,
    numpy loads with allow_pickle=True."""
    tree = ast.parse(source, filename)
    torch_names, load_names, found = {"torch"}, set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch":
                    torch_names.add(alias.asname or "torch")
                if alias.name.split(".")[0] in PICKLERS:
                    found.append(f"{filename}:{node.lineno}: imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PICKLERS:
                found.append(f"{filename}:{node.lineno}: imports from {node.module}")
            if node.module in ("torch", "torch.serialization"):
                load_names |= {a.asname or a.name for a in node.names if a.name == "load"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        kw = {k.arg: k.value for k in node.keywords}
        head, _, attr = name.rpartition(".")
        if (head in torch_names and attr == "load") or name in load_names:
            if not _is_true(kw.get("weights_only")):
                found.append(f"{filename}:{node.lineno}: {name}(...) without weights_only=True")
        elif attr in ("load", "loads") and _is_true(kw.get("allow_pickle")):
            found.append(f"{filename}:{node.lineno}: {name}(..., allow_pickle=True)")
    return found


def test_the_package_never_unpickles():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the scan sees the whole package
    found = [line for f in files for line in unsafe_loads(f.read_text(encoding="utf-8"), str(f))]
    assert not found, "unpickling code in the package:\n" + "\n".join(found)


def test_the_scan_finds_every_spelling_of_an_unsafe_load():
    bad = {
        "import torch\ntorch.load(p)\n": 1,
        "import torch\ntorch.load(p, weights_only=False)\n": 1,
        "import torch as t\nt.load(p, map_location='cpu')\n": 1,
        "from torch import load\nload(p)\n": 1,
        "from torch import load as tl\ntl(p, weights_only=flag)\n": 1,
        "import pickle\n": 1,
        "from pickle import loads\n": 1,
        "import numpy as np\nnp.load(p, allow_pickle=True)\n": 1,
    }
    for src, n in bad.items():
        assert len(unsafe_loads(src)) == n, src
    good = "import torch\ntorch.load(p, weights_only=True)\nimport json\njson.load(f)\nnp.load(p)\n"
    assert unsafe_loads(good) == []


def test_what_the_package_saves_loads_with_weights_only(tmp_path):
    """The trainer's checkpoint holds RNG states and plain containers: weights_only can load them."""
    import random

    gen = torch.Generator().manual_seed(3)
    obj = {"step": 4, "gen": gen.get_state(), "torch_rng": torch.get_rng_state(), "py_random": random.getstate(),
           "optimizer": torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).state_dict(),
           "hparams": {"lr": 1e-3, "name": None}, "log": [{"step": 1, "loss": 0.5}]}
    torch.save(obj, tmp_path / "t.pt")
    back = torch.load(tmp_path / "t.pt", weights_only=True)
    assert back["py_random"] == obj["py_random"] and torch.equal(back["gen"], obj["gen"])
