"""Packed batches for Hugging Face ``transformers.Trainer`` and TRL's ``SFTTrainer``.

``PackedTrainer`` (and ``PackedSFTTrainer``, or :func:`packed_trainer_class` for any other Trainer
subclass) trains on a :class:`~packloader.PackedDataLoader` instead of building its own
``DataLoader``, and keeps the loader's guarantees::

    import ops
    from packloader import PackedDataLoader
    from packloader.hf import PackedTrainer

    model = transformers.MambaForCausalLM(config)
    ops.enable_packing(model)                                # packed rows without leaks (ops/hf.py)
    loader = PackedDataLoader("tokens/", capacity=2048, batch_size=8, seed=0)
    trainer = PackedTrainer(model=model, args=TrainingArguments("out", max_steps=1000, save_steps=100),
                            train_loader=loader)
    trainer.train()                                          # or train(resume_from_checkpoint=True)

What it does:

- ``get_train_dataloader`` returns the loader itself (wrapped to hand the model ``input_ids``,
  ``labels`` and ``position_ids``): accelerate does not re-shard it, so every rank gets the loader's
  own share, the same number of batches on every rank, and one epoch covers every sequence once.
  Trainer calls ``set_epoch`` on it at every epoch.
- Every checkpoint (``checkpoint-N/``) also holds ``packloader_state.json``, the loader's
  ``state_dict()``; ``train(resume_from_checkpoint=...)`` loads it into the loader, which then starts
  at the saved batch. Trainer keeps its own bookkeeping of the resumed epoch (the step count that
  decides where gradient accumulation ends, the RNG state), but its fast-forwarding, which would read
  and drop every skipped batch, is answered by the loader's resume point instead (during ``train`` only,
  ``transformers.trainer.skip_first_batches`` hands our loader back as it is, after checking that
  Trainer wants to skip exactly the batches the loader state says were consumed). The resumed run
  sees exactly the batches the uninterrupted run would have.
- The loss: Trainer passes ``num_items_in_batch`` (the labels that are not -100, summed over the
  gradient-accumulation micro-batches and, with ``average_tokens_across_devices``, over ranks) to the
  model, whose loss is then the summed token loss divided by the real label count. The loader marks
  every sequence start -100, so that count is the batch's ``num_loss_tokens``.

The model must have been converted with :func:`ops.enable_packing` (a plain transformers Mamba
model ignores ``position_ids`` and leaks across packed sequences); this is checked.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, Optional

from packloader._outdir import atomic_write_text

__all__ = ["PackedTrainerMixin", "packed_trainer_class", "PackedTrainer", "PackedSFTTrainer",
           "LOADER_STATE_NAME", "MODEL_KEYS"]

LOADER_STATE_NAME = "packloader_state.json"
MODEL_KEYS = ("input_ids", "labels", "position_ids")  # what the trainer hands the model of each batch
# with overflow="carry", the continuation keys too (packloader.batch.CARRY_BATCH_KEYS): the converted model carries
# the state across pieces (ops.carry) and keeps the states of documents that go on in a later step in its state cache
CARRY_KEYS = ("piece_doc_ids", "piece_index", "has_initial_state", "continues_after")
STATES_NAME = "packloader_states_rank{rank}.pt"   # a rank's state cache in a checkpoint (overflow="carry")


class _TrainerBatches:
    """The loader as Trainer sees it: batches restricted to :data:`MODEL_KEYS`; ``len`` and
    ``set_epoch`` forwarded, checking that Trainer resumes the epoch the loader state is in."""

    def __init__(self, loader, resumed: Optional[dict] = None):
        self.loader = loader
        self.resumed = resumed  # the loaded state, until the first set_epoch

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        saved, self.resumed = self.resumed, None
        if saved is not None and epoch != saved["epoch"]:
            finished = saved["batches_consumed"] >= self.loader.num_batches(saved["epoch"])
            if not (finished and epoch == saved["epoch"] + 1):
                raise RuntimeError(
                    f"resuming: Trainer starts epoch {epoch} but the loader state is at batch "
                    f"{saved['batches_consumed']} of epoch {saved['epoch']}; the checkpoint and the loader settings "
                    "(batch size, data, seed) or TrainingArguments (gradient accumulation) do not match"
                )
        self.loader.set_epoch(epoch)

    def skip_to(self, num_batches: int) -> "_TrainerBatches":
        """Trainer's fast-forward of the resumed epoch: the loader is already there."""
        have = None if self.resumed is None else self.resumed["batches_consumed"]
        if have != num_batches:
            raise RuntimeError(
                f"resuming: Trainer skips {num_batches} batches of the epoch but the loader state says "
                f"{have} were consumed; the checkpoint and the loader settings or TrainingArguments do not match"
            )
        return self

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for batch in self.loader:
            yield {k: batch[k] for k in MODEL_KEYS + CARRY_KEYS if k in batch}


def _is_converted(model) -> bool:
    seen = set()
    while model is not None and id(model) not in seen:  # unwrap DDP / accelerate / PEFT wrappers
        seen.add(id(model))
        if getattr(model, "_packloader_conversion", None) is not None:
            return True
        model = getattr(model, "module", None) or getattr(model, "base_model", None)
    return False


def _is_trl_trainer(cls: type) -> bool:
    return any((c.__module__ or "").split(".")[0] == "trl" for c in cls.__mro__)


def _prepare_trl_kwargs(args: tuple, kwargs: dict) -> None:
    """TRL's trainers insist on a ``train_dataset`` they tokenize up front: give them a one-row
    placeholder (never iterated: the loader feeds training) and skip their preparation."""
    if len(args) < 4 and kwargs.get("train_dataset") is None:  # (model, args, data_collator, train_dataset)
        import datasets

        kwargs["train_dataset"] = datasets.Dataset.from_dict({"input_ids": [[0, 0]]})
    cfg = kwargs.get("args", args[1] if len(args) > 1 else None)
    if cfg is not None and hasattr(cfg, "dataset_kwargs"):
        cfg.dataset_kwargs = {**(cfg.dataset_kwargs or {}), "skip_prepare_dataset": True}


def _loader_state_path(checkpoint: str) -> str:
    return os.path.join(checkpoint, LOADER_STATE_NAME)


class PackedTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (first base): train on a ``PackedDataLoader``.

    Args:
        train_loader: the :class:`~packloader.PackedDataLoader` to train on (``train_dataset`` is not
            used for training). Its ``batch_size`` is the per-device batch size; Trainer's
            ``per_device_train_batch_size`` and dataloader settings do not apply to it.
        check_model: refuse a model not converted by :func:`ops.enable_packing` (default True).
        *args, **kwargs: the Trainer's own arguments.
    """

    def __init__(self, *args, train_loader=None, check_model: bool = True, **kwargs):
        if train_loader is None:
            raise ValueError(f"{type(self).__name__} needs train_loader=PackedDataLoader(...)")
        for attr in ("state_dict", "load_state_dict", "set_epoch"):
            if not hasattr(train_loader, attr):
                raise TypeError(f"train_loader must be a packloader.PackedDataLoader (it has no {attr}()), got "
                                f"{type(train_loader).__name__}")
        self.train_loader = train_loader
        self._packloader_resume: Optional[str] = None
        if _is_trl_trainer(type(self)):
            _prepare_trl_kwargs(args, kwargs)
        super().__init__(*args, **kwargs)
        if check_model and not _is_converted(self.model):
            raise ValueError(
                f"{type(self).__name__}: the model ({type(self.model).__name__}) is not converted for packed "
                "batches; call ops.enable_packing(model) first (an unconverted model ignores position_ids and its "
                "packed sequences leak into each other), or pass check_model=False"
            )
        from transformers import TrainerCallback

        trainer = self

        class _SaveLoaderState(TrainerCallback):
            def on_save(self, args, state, control, **kw):
                checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
                if state.is_world_process_zero:
                    trainer._save_loader_state(checkpoint)
                trainer._save_state_cache(checkpoint)

        self.add_callback(_SaveLoaderState())

    def _state_cache(self, create: bool = False):
        """The converted model's state cache (ops.StateCache; overflow="carry"), None if it has none."""
        model = self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model
        cache = model.__dict__.get("_packloader_state_cache")
        if cache is None and create:
            from ops.carry import StateCache
            cache = model.__dict__["_packloader_state_cache"] = StateCache()
        return cache

    def _save_state_cache(self, checkpoint: str) -> None:
        """Every rank's state cache (the states of documents that continue after the checkpoint) beside the loader
        state, so that a resumed run continues every chain exactly."""
        cache = self._state_cache()
        if cache is None:
            return
        import torch
        os.makedirs(checkpoint, exist_ok=True)
        path = os.path.join(checkpoint, STATES_NAME.format(rank=self.args.process_index))
        torch.save(cache.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)

    def _save_loader_state(self, checkpoint: str) -> None:
        if not os.path.isdir(checkpoint):
            raise FileNotFoundError(f"{type(self).__name__}: checkpoint folder {checkpoint!r} was not written")
        atomic_write_text(_loader_state_path(checkpoint), json.dumps(self.train_loader.state_dict()), beside=True)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        path = resume_from_checkpoint
        if isinstance(path, bool) and path:
            from transformers.trainer_utils import get_last_checkpoint

            path = get_last_checkpoint(self.args.output_dir)
            if path is None:
                raise ValueError(f"resume_from_checkpoint=True but no checkpoint found in {self.args.output_dir!r}")
        if isinstance(path, (str, os.PathLike)) and path:
            state_file = _loader_state_path(os.fspath(path))
            if not os.path.exists(state_file):
                raise FileNotFoundError(
                    f"{state_file} is missing: this checkpoint was not written by a packed trainer, so the loader "
                    "cannot resume exactly"
                )
            self._packloader_resume = os.fspath(path)
            resume_from_checkpoint = os.fspath(path)
            if self.args.ignore_data_skip:
                raise ValueError("ignore_data_skip=True would restart the epoch's bookkeeping at its first batch "
                                 "while the loader resumes mid-epoch; leave it False with a packed trainer")
        import transformers.trainer as hf_trainer

        original = getattr(hf_trainer, "skip_first_batches", None)

        def skip_first_batches(dataloader, num_batches=0):
            if isinstance(dataloader, _TrainerBatches):
                return dataloader.skip_to(num_batches)
            return original(dataloader, num_batches)

        if original is not None:
            hf_trainer.skip_first_batches = skip_first_batches
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if original is not None:
                hf_trainer.skip_first_batches = original
            self._packloader_resume = None

    def get_train_dataloader(self):
        resumed = None
        if self._packloader_resume is not None:
            with open(_loader_state_path(self._packloader_resume)) as f:
                resumed = json.load(f)
            self.train_loader.load_state_dict(resumed)
            states = os.path.join(self._packloader_resume, STATES_NAME.format(rank=self.args.process_index))
            if os.path.exists(states):
                import torch
                self._state_cache(create=True).load_state_dict(torch.load(states, weights_only=True))
            self._packloader_resume = None
        return _TrainerBatches(self.train_loader, resumed)


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"packloader.hf needs {module}: pip install 'packloader[{extra}]' ({e})") from e


_CLASSES: Dict[type, type] = {}


def packed_trainer_class(base: type) -> type:
    """``base`` (``transformers.Trainer`` or a subclass, e.g. TRL's ``SFTTrainer``) with
    :class:`PackedTrainerMixin` mixed in; the same class for the same base."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(f"Packed{base.__name__}", (PackedTrainerMixin, base), {"__module__": __name__,
                                                                          "__doc__": PackedTrainerMixin.__doc__})
        _CLASSES[base] = cls
    return cls


def __getattr__(name: str):
    # imported lazily: ``import packloader.hf`` needs neither transformers nor trl
    if name == "PackedTrainer":
        return packed_trainer_class(_require("transformers", "hf").Trainer)
    if name == "PackedSFTTrainer":
        return packed_trainer_class(_require("trl", "trl").SFTTrainer)
    raise AttributeError(f"module 'packloader.hf' has no attribute {name!r}")
