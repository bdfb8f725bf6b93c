"""Tensors in the step path are made on the device of the tensors they meet.

An AST scan of the modules a forward step runs through: every torch tensor factory call
(`torch.empty`, `zeros`, `ones`, `full`, `arange`, `tensor`, `randn`, `rand`) must pass
`device=`, or be in ALLOWED with the reason it is meant to be a host tensor. A factory
without a device makes a CPU tensor, which on a GPU fails at the first op that mixes it
with a device tensor (or syncs the step).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "randn", "rand"}
STEP_PATH = ["engine/model_runner.py", "engine/hybrid_kv.py", "engine/spec/verify.py",
             "engine/expert_parallel.py",
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "engine/models").glob("*.py"))]

# (module, enclosing function, factory) -> why the tensor belongs on the host
ALLOWED = {
    ("engine/hybrid_kv.py", "swa_step_inputs", "full"):
        "host SWA block table; ModelRunner.prepare moves it to the device (StepTransfer)",
    ("engine/hybrid_kv.py", "swa_step_inputs", "tensor"):
        "host SWA block ids; ModelRunner.prepare moves the slot mapping to the device",
    ("engine/hybrid_kv.py", "swa_step_inputs", "arange"):
        "host positions for the SWA slot mapping, copied with it",
    ("engine/models/gemma3.py", "Gemma3ForCausalLM.__init__", "tensor"):
        "load time: the embedding scale is built with the weights on the host and moved "
        "with them (engine.platform.place)",
    ("engine/models/gemma3.py", "Gemma3ForCausalLM.rope_cache", "arange"):
        "load time: the rope cache is built on the host and placed with the weights",
    ("engine/models/deepseek_v3.py", "yarn_inv_freq", "arange"):
        "load time: yarn frequencies for the rope cache, placed with the weights",
}


def factory_calls(path: str):
    """(enclosing function qualname, factory name, line, has device=) of each torch factory."""
    tree = ast.parse((ROOT / path).read_text())
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch" \
                    and child.func.attr in FACTORIES:
                has_device = any(k.arg == "device" for k in child.keywords)
                found.append((scope, child.func.attr, child.lineno, has_device))
            visit(child, inner)

    visit(tree, "")
    return found


def test_step_path_factories_name_a_device():
    missing = [f"{path}:{line} torch.{name} in {scope or '<module>'}"
               for path in STEP_PATH for scope, name, line, has_device in factory_calls(path)
               if not has_device and (path, scope, name) not in ALLOWED]
    assert not missing, "tensor factories without device= in the step path (pass the " \
        "device of the tensors they meet, or allow-list a host tensor with its reason):\n" \
        + "\n".join(missing)


def test_allow_list_has_no_stale_entries():
    used = {(path, scope, name) for path in STEP_PATH
            for scope, name, _, has_device in factory_calls(path) if not has_device}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that match no call any more: {stale}"


def test_scanner_sees_a_factory_without_device(tmp_path, monkeypatch):
    monkeypatch.setitem(factory_calls.__globals__, "ROOT", tmp_path)
    (tmp_path / "m.py").write_text("import torch\nclass A:\n    def f(self, x):\n"
                                   "        return torch.zeros(3), torch.ones(2, device=x.device)\n")
    assert factory_calls("m.py") == [("A.f", "zeros", 4, False), ("A.f", "ones", 4, True)]
