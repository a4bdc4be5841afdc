"""Resuming multi-process training on CPUs: accelerate names each CPU rank's device ``cpu:<local rank>``, and
transformers (5.17) loads the checkpoint's optimizer with ``map_location=args.device`` when there are several
processes; torch cannot restore storages to ``cpu:0`` ("don't know how to restore data location"), so every
multi-process CPU resume fails. The fix: the trainer's cached device becomes plain ``cpu`` (the same memory).

Reaches into ``TrainingArguments``' cached ``_setup_devices``; where that is not how the device is cached, nothing
is changed (the public path: the resume fails as it would without this module).
Must not import: Prefect, MLflow.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def plain_cpu_device(args: Any) -> bool:
    """Make a CPU device with an index (``cpu:0``) plain ``cpu`` on ``args`` (a ``TrainingArguments``); returns
    whether it changed anything.

    >>> import torch
    >>> class Args:  # how TrainingArguments caches its device
    ...     @property
    ...     def device(self): return self.__dict__["_setup_devices"]
    >>> args = Args(); args.__dict__["_setup_devices"] = torch.device("cpu", 0)
    >>> plain_cpu_device(args), args.device
    (True, device(type='cpu'))
    """
    import torch

    device = getattr(args, "device", None)
    if not isinstance(device, torch.device) or device.type != "cpu" or device.index is None:
        return False
    cached = vars(args).get("_setup_devices")
    if cached != device:
        logger.warning("cannot make the trainer's device %s plain cpu: a multi-process CPU resume may fail", device)
        return False
    vars(args)["_setup_devices"] = torch.device("cpu")
    return True
