"""Headers that do not match the configuration are rejected with the field named."""

import pytest
import torch

from afore.plan import Target
from afore.transport.connector import HEADER_LEN, MAGIC, TransportConfig, _header, check_header

CFG = TransportConfig("127.0.0.1", 29999, 2, 3, hidden=16, top_k=4, dtype=torch.float32)


def test_round_trip():
    seq, target, n = check_header(_header(7, Target(1, 2, 3), 5, CFG), CFG, "test")
    assert (seq, target, n) == (7, Target(1, 2, 3), 5)


@pytest.mark.parametrize("index,value,field", [(0, 123, "magic"), (6, 17, "hidden"), (7, 3, "top_k"),
                                               (8, 1, "dtype"), (5, -1, "num_tokens"), (1, -2, "target")])
def test_bad_header_names_the_field(index, value, field):
    header = _header(7, Target(1, 2, 3), 5, CFG)
    header[index] = value
    with pytest.raises(ValueError, match=field):
        check_header(header, CFG, "request from attention rank 0")


def test_config_is_validated():
    with pytest.raises(ValueError, match="backend"):
        TransportConfig("h", 1, 1, 1, 8, 2, backend="mpi")
    with pytest.raises(ValueError, match="num_ffn"):
        TransportConfig("h", 1, 1, 0, 8, 2)
    assert len(_header(0, Target(0, 0, 0), 0, CFG)) == HEADER_LEN and MAGIC
