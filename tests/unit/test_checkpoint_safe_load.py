"""Issue 16 item 10: checkpoints are read without unpickling code: DCP's .metadata through an allow-list
unpickler, non-tensor entries with torch.load(weights_only=True); a real checkpoint still round-trips."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from streamrft.checkpoint.safe_load import SafeFileSystemReader, WeightsOnlyLoadPlanner, load_metadata


class RunsCode:
    """An object whose unpickling calls os.system: what a hostile checkpoint would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_item10_metadata_that_names_a_foreign_global_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    hostile = pickle.dumps({"state_dict_metadata": RunsCode(marker)})
    with pytest.raises(pickle.UnpicklingError, match=r"checkpoint metadata refers to (posix|os)\.system, which a DCP "
                                                     r"metadata file never holds; refusing to load it"):
        load_metadata(io.BytesIO(hostile))
    assert not marker.exists()
    (tmp_path / ".metadata").write_bytes(hostile)
    with pytest.raises(pickle.UnpicklingError):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not marker.exists()


def test_item10_a_non_tensor_entry_is_loaded_weights_only(tmp_path):
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"last_epoch": RunsCode(marker)}, buffer)
    buffer.seek(0)
    planner = WeightsOnlyLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}

    class Item:  # the planner only reads dest_index.fqn
        class dest_index:
            fqn = "scheduler"

    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        planner.load_bytes(Item, buffer)
    assert not marker.exists()
    buffer = io.BytesIO()
    torch.save({"last_epoch": 3, "base_lrs": [0.1], "betas": (0.9, 0.99)}, buffer)
    buffer.seek(0)
    planner.load_bytes(Item, buffer)
    assert planner.state_dict["scheduler"] == {"last_epoch": 3, "base_lrs": [0.1], "betas": (0.9, 0.99)}


def test_item10_a_real_checkpoint_metadata_reads_through_the_allow_list(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "sched": {"last_epoch": 2, "lrs": [0.5]}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    meta = SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert {"w", "sched.last_epoch", "sched.lrs"} <= set(meta.state_dict_metadata)
    loaded = {"w": torch.zeros(2, 3), "sched": {"last_epoch": 0, "lrs": [0.0]}}
    dcp.load(loaded, no_dist=True, storage_reader=SafeFileSystemReader(str(tmp_path)), planner=WeightsOnlyLoadPlanner())
    assert torch.equal(loaded["w"], state["w"]) and loaded["sched"] == {"last_epoch": 2, "lrs": [0.5]}
