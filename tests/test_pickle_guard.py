"""No tensor through pickle (engine/transport/pickle_guard.py): message headers and object collectives refuse tensors
and storages, naming where they sit; log values become host numbers before an object collective."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from lightning_paci.engine.transport.local_mailbox import LocalComm
from lightning_paci.engine.transport.pickle_guard import TensorPickleError, check_no_tensors, guarded_dumps
from lightning_paci.integration.stage.logs import LogRecord, host_records


class _Holder:
    """A non-tensor object holding tensors, as a transformers Cache does."""

    def __init__(self) -> None:
        self.layers = [{"keys": torch.zeros(2, 3)}]


def test_plain_values_pickle_as_pickle_does():
    value = ({"n": 3, "text": "torch._utils and torch.storage are only words here"}, [1.5, None, (2, "x")])
    assert pickle.loads(guarded_dumps(value, what="a header")) == value


def test_a_tensor_inside_an_object_is_refused_with_its_path():
    with pytest.raises(TensorPickleError, match=r"^stage 0: the message to stage 1: \[1\]\['cache'\]<_Holder>"
                                                r"\.layers\[0\]\['keys'\] is a tensor of shape \(2, 3\) "
                                                r"torch\.float32 on cpu, and it would be pickled\."):
        guarded_dumps((1, {"cache": _Holder()}), what="stage 0: the message to stage 1")


@pytest.mark.parametrize("value", [torch.tensor(1.0), nn.Parameter(torch.ones(2)), torch.ones(2).untyped_storage()],
                         ids=["tensor", "parameter", "storage"])
def test_tensors_parameters_and_storages_are_refused(value):
    with pytest.raises(TensorPickleError, match="log records: .* on cpu, and it would be pickled"):
        check_no_tensors([("loss", value)], what="log records")


def test_host_state_dicts_may_carry_cpu_tensors_only():
    check_no_tensors({"w": torch.ones(3), "step": 2}, what="a gather", host_tensors=True)
    with pytest.raises(TensorPickleError, match=r"a gather: \['w'\] is a tensor of shape \(3,\) torch\.float32 "
                                                r"on meta"):
        check_no_tensors({"w": torch.empty(3, device="meta")}, what="a gather", host_tensors=True)


def test_a_message_with_an_object_holding_tensors_is_refused_by_the_transport():
    # tensors in containers travel as tensors; a tensor inside another object would ride in the header
    comms = LocalComm.network(2)
    comms[0].send(((torch.ones(2), {"mask": torch.zeros(2, dtype=torch.bool)}), [LogRecord("a", 1.0, 2, ())]), 1)
    assert torch.equal(comms[1].recv(0)[0][0], torch.ones(2))
    with pytest.raises(TensorPickleError, match=r"stage 0: the message to stage 1: \[1\]<_Holder>\.layers"):
        comms[0].send((torch.ones(2), _Holder()), 1)


def test_log_values_become_host_numbers_before_an_object_collective():
    records = [LogRecord("loss", torch.tensor(0.25), 4, ()), LogRecord("acc", 0.5, 4, (("prog_bar", True),))]
    with pytest.raises(TensorPickleError):
        check_no_tensors(records, what="evaluation log records")
    host = host_records(records)
    check_no_tensors(host, what="evaluation log records")
    assert host == [LogRecord("loss", 0.25, 4, ()), LogRecord("acc", 0.5, 4, (("prog_bar", True),))]
