"""An optional integration imports without its framework, and says which extra to
install when it is used (a fresh clone's suite, without DeepSpeed, imports every module)."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Per integration: the framework hidden, the code that imports the module and lists its
#: uses (each must raise an ImportError naming the extra), the extra, how many uses.
CASES = {
    "deepspeed": (
        "deepspeed",
        "import distckpt.integrations.deepspeed as engine\n"
        "import distckpt.integrations.deepspeed.types as types\n"
        "uses = (lambda: engine.use_distckpt(None), engine.DistckptCheckpointEngine,\n"
        "        lambda: types.decode({types.TYPE_TAG: 'torch.Size', 'value': [1]}))\n",
        3,
    ),
    "megatron": (
        "megatron",
        "import distckpt.integrations.megatron as megatron\n"
        "from distckpt.integrations.megatron import layout, leaves\n"
        "uses = (megatron.DistckptSaveStrategy, megatron.DistckptLoadStrategy,\n"
        "        lambda: megatron.save_state({}), lambda: leaves.save_state({}),\n"
        "        megatron.register_default_distckpt_strategies)\n",
        5,
    ),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("extra", sorted(CASES))
def test_without_its_framework_the_module_imports_and_its_use_names_the_extra(
    extra: str,
) -> None:
    hidden, imports, count = CASES[extra]
    code = (
        "import sys\n"
        f"sys.modules[{hidden!r}] = None  # any import of it fails\n"
        f"{imports}"
        "for use in uses:\n"
        "    try:\n"
        "        use()\n"
        "    except ImportError as exc:\n"
        "        print('REFUSED', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == count, done.stdout
    assert all(f"pip install 'distckpt[{extra}]'" in line for line in lines), lines
