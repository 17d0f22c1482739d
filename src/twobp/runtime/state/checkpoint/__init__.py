"""Checkpoints of a pipeline: ``torch.distributed.checkpoint`` tensors, a JSON manifest, atomic.

A folder of checkpoints holds one sub-folder per saved step::

    checkpoints/
      step-00000200/
        __0_0.distcp      tensors of pipeline rank 0, in torch.distributed.checkpoint (DCP)
        __1_0.distcp      format: weights and buffers, optimizer state, RNG states, by name
        .metadata         DCP's index of every tensor (written once all data is in place)
        manifest.json     written last: step, schedule, stages, optimizer groups, RNG
                          rest, every rank's extra, the loss scaler's state, each
                          file's size and CRC-32 (JSON)

The tensors are named as in the single-process model (``model.3.attn.q.weight``,
``optimizer.state.3.attn.q.weight.exp_avg``; see :mod:`.entries`),
so a checkpoint loads into another partition, schedule or number of ranks, and
``torch.distributed.checkpoint.load`` reads it without twobp. One replica of
each stage writes (:attr:`Topology.writes_stage_files`). With tensor
parallelism each rank writes its own shards of the split tensors, as DTensors
(chunks of the whole tensor; see :mod:`.tensor_shards`), and every shard's
pipeline saves and loads together.

Every rank writes into ``.partial-step-00000200``; once all have, rank 0 writes
the manifest and renames the folder to ``step-00000200``. A crash at any
moment leaves the earlier checkpoints as they were: a folder without a manifest
is never loaded, and older checkpoints are deleted only after the new one is
complete. With ``async_save=True`` the tensors are copied at once and written
in the background; rank 0 completes the checkpoint when every rank's data is
written, and the next ``save``, ``load`` or :func:`wait` reports how it went.

Loading first checks the files against the manifest (sizes, and CRC-32s that
the ranks split between them; see :mod:`.integrity`): a damaged
checkpoint raises a :class:`CheckpointError` naming the file and the previous
intact checkpoint. Loading unpickles nothing from the checkpoint: tensors are read with
``weights_only``, DCP's metadata through an allow-list of its own classes, and
the rest is JSON. The folder must be on a file system every rank sees.

The modules: :mod:`.saving` (:func:`save`, :func:`wait`) and :mod:`.loading`
(:func:`load`, :func:`merge`) run on :mod:`.files` (the folders and the
manifest), :mod:`.entries` (what is saved, as named tensors and JSON),
:mod:`.shards` (a sharded optimizer's parts), :mod:`.tensor_shards`
(tensor-parallel shards), :mod:`.integrity` (sizes and CRC-32s),
:mod:`.storage` (DCP, read safely) and :mod:`.background` (saves written in
the background); :mod:`.convert` brings a checkpoint of the first format to
the current one.
"""

from twobp.runtime.state.checkpoint.background import BackgroundSaves
from twobp.runtime.state.checkpoint.files import (
    find_checkpoint,
    is_checkpoint,
    latest_checkpoint,
    read_manifest,
)
from twobp.runtime.state.checkpoint.loading import load, merge
from twobp.runtime.state.checkpoint.saving import save, wait

__all__ = [
    "BackgroundSaves",
    "find_checkpoint",
    "is_checkpoint",
    "latest_checkpoint",
    "load",
    "merge",
    "read_manifest",
    "save",
    "wait",
]
