"""An optional integration imports without its framework, and says which extra to
install when it is used (a fresh clone's suite, without DeepSpeed, imports every module)."""

from __future__ import annotations

import subprocess
import sys


def test_without_deepspeed_the_module_imports_and_its_use_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['deepspeed'] = None  # any import of it fails\n"
        "import distckpt.integrations.deepspeed as engine\n"
        "import distckpt.integrations.deepspeed.types as types\n"
        "for use in (lambda: engine.use_distckpt(None), engine.DistckptCheckpointEngine,\n"
        "            lambda: types.decode({types.TYPE_TAG: 'torch.Size', 'value': [1]})):\n"
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
    assert len(lines) == 3, done.stdout
    assert all("pip install 'distckpt[deepspeed]'" in line for line in lines), lines


def test_without_megatron_core_the_module_imports_and_its_use_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['megatron'] = None  # any import of it fails\n"
        "import distckpt.integrations.megatron as megatron\n"
        "from distckpt.integrations.megatron import layout, leaves\n"
        "for use in (megatron.DistckptSaveStrategy, megatron.DistckptLoadStrategy,\n"
        "            lambda: megatron.save_state({}), leaves.save_state,\n"
        "            megatron.register_default_distckpt_strategies):\n"
        "    try:\n"
        "        use() if use is not leaves.save_state else use({})\n"
        "    except ImportError as exc:\n"
        "        print('REFUSED', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 5, done.stdout
    assert all("pip install 'distckpt[megatron]'" in line for line in lines), lines
