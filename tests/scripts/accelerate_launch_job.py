"""What ``accelerate launch`` starts, for tests/integrations/test_accelerate_launch.py.

``accelerate_launch_job.py DIR [no-cpu]``: every process makes a DistckptAccelerator
(``cpu=True`` unless ``no-cpu``), prepares a small model and saves its state at DIR;
each prints ``PROCESS <index> OF <count>``.
"""

from __future__ import annotations

import sys

import torch

from distckpt.integrations.accelerate import DistckptAccelerator

accelerator = DistckptAccelerator(cpu="no-cpu" not in sys.argv)
model = accelerator.prepare(torch.nn.Linear(4, 2))
print(f"PROCESS {accelerator.process_index} OF {accelerator.num_processes}", flush=True)
if "no-cpu" not in sys.argv:
    accelerator.save_state(sys.argv[1])
accelerator.end_training()
