"""Hashing what a pickle builds: the C unpickler hashes every dict key and set element, and a
tuple's hash is not cached, so a tuple of memoised tuples, each holding the one before twice,
takes 2^depth steps to hash. Each bomb here is deep enough to take seconds on the old reader
(26 links: about 4 s; each link doubles it) and must be refused in well under a second with a
one-line error naming the file; real torch.save files sharing tuples load as before.
"""

from __future__ import annotations

import pytest
import torch
from hostile_files import PROTO, archive, distinct_ints, get, glob, integer, put
from test_budget import expect_refused_within_budget

from zeroshard.importers import pickle_scan
from zeroshard.importers.torch_file import TorchFileError, load_torch_file

DEPTH = 26


def chain(depth: int = DEPTH, first_index: int = 100) -> bytes:
    """None, then ``depth`` times: memoise the top, get it, TUPLE2 (the top held twice)."""
    links = (put(first_index + i) + get(first_index + i) + b"\x86" for i in range(depth))
    return b"N" + b"".join(links)


BOMBS = {  # each hashes the chain once
    "dict key": b"}" + chain() + b"Ns",
    "OrderedDict key": glob("collections.OrderedDict") + b")R" + chain() + b"Ns",
    "set element (ADDITEMS)": b"\x8f(" + chain() + b"\x90",
    "frozenset element": b"(" + chain() + b"\x91",
    "set() argument": glob("builtins.set") + chain() + b"\x85\x85R",
    "torch.Size argument, as a key": b"}" + glob("torch.Size") + chain() + b"\x85\x85R" + b"Ns",
    "a tuple holding it, as a key": b"}" + chain() + integer(7) + b"\x86Ns",
}


@pytest.mark.parametrize("case", list(BOMBS))
def test_a_tuple_that_doubles_at_each_link_is_refused_before_it_is_hashed(tmp_path, case):
    path = archive(tmp_path / "bomb.pt", PROTO + BOMBS[case] + b".")
    expect_refused_within_budget(path, "hashing")


def test_one_memoised_tuple_used_as_a_key_again_and_again_is_refused(tmp_path):
    """A tuple of 2,000 ints as the key of 20,000 SETITEMs: 40 M hashing steps from 60 KB."""
    data = PROTO + b"}(" + distinct_ints(2000) + b"t" + put(0) + b"0(" + (get(0) + b"N") * 20_000 + b"u."
    expect_refused_within_budget(archive(tmp_path / "keys.pt", data), "hashing")


@pytest.mark.parametrize("qualname", ["torch.Size", "builtins.set"])
def test_a_memoised_list_holding_a_big_tuple_copied_into_keys_is_refused(tmp_path, qualname):
    """torch.Size(L) and set(L) of a list L holding one tuple of 4,000 ints, 5,000 times:
    no tuple is memoised, the list hides it (the old reader hashed 20 M items)."""
    hidden = b"](" + b"(" + distinct_ints(4000) + b"t" + b"e" + put(0) + b"0"
    call = glob(qualname) + put(1) + b"0"
    if qualname == "torch.Size":  # the copy as a key
        repeated = get(1) + get(0) + b"\x85R" + b"N"
        data = PROTO + hidden + call + b"}(" + repeated * 5000 + b"u."
    else:
        data = PROTO + hidden + call + b"](" + (get(1) + get(0) + b"\x85R") * 5000 + b"e."
    words = "torch.Size" if qualname == "torch.Size" else "hashing"
    expect_refused_within_budget(archive(tmp_path / "hidden.pt", data), words)


def test_a_tuple_nested_deeper_than_the_c_stack_is_refused(tmp_path):
    """Hashing a tuple nested 200,000 deep overflowed the C stack (segmentation fault)."""
    data = PROTO + b"}N" + b"\x85" * 200_000 + b"Ns."
    expect_refused_within_budget(archive(tmp_path / "deep.pt", data), "nested")


# ---- what real files share loads as before ---------------------------------------------------------


def adam_state(groups: int) -> dict:
    """An optimizer state dict as torch writes one: every group shares the defaults' betas."""
    parameters = [torch.nn.Parameter(torch.ones(3)) for _ in range(groups)]
    optimizer = torch.optim.Adam([{"params": [p]} for p in parameters], betas=(0.8, 0.99))
    parameters[0].grad = torch.ones(3)
    optimizer.step()
    return optimizer.state_dict()


@pytest.mark.parametrize("groups", [2, 40])
def test_shared_tuples_of_a_real_optimizer_state_load(tmp_path, groups, monkeypatch):
    """2 groups share one betas tuple (one memo get: no simulation); 40 share it 39 times,
    which the cheap bound cannot clear: the exact count runs, and passes it."""
    state = adam_state(groups)
    assert all(group["betas"] is state["param_groups"][0]["betas"] for group in state["param_groups"])
    path = tmp_path / "adam.pt"
    torch.save(state, path)
    counted = []
    original = pickle_scan.hash_steps
    monkeypatch.setattr(pickle_scan, "hash_steps", lambda *a: counted.append(1) or original(*a))
    monkeypatch.setattr(pickle_scan, "_PASSED", {})
    loaded = load_torch_file(path)
    assert [group["betas"] for group in loaded["param_groups"]] == [(0.8, 0.99)] * groups
    assert [group["params"] for group in loaded["param_groups"]] == [[i] for i in range(groups)]
    assert loaded["state"][0]["step"].shape == ()
    assert len(counted) == (groups > 2)


def test_a_shared_tuple_key_and_a_torch_size_load(tmp_path):
    key = (1, (2, 3))
    value = {"a": {key: 1}, "b": key, "c": {key: 2, (key, key): 3}, "shape": torch.Size([4, 5])}
    path = tmp_path / "keys.pt"
    torch.save(value, path)
    assert load_torch_file(path) == value


def test_a_torch_size_of_anything_but_ints_is_refused(tmp_path):
    data = PROTO + glob("torch.Size") + integer(1) + b"N\x86\x85R."
    with pytest.raises(TorchFileError, match="torch.Size"):
        load_torch_file(archive(tmp_path / "size.pt", data))


def test_a_put_after_what_did_not_make_it_takes_the_exact_count(monkeypatch):
    """PROTO, MARK, POP, a get or a put before a put: what is memoised was made earlier, so the
    cheap bound does not hold and the exact count runs; a GLOBAL cut short is still refused."""
    from zeroshard.importers.torch_records import FileProblem

    counted = []
    monkeypatch.setattr(pickle_scan, "hash_steps", lambda data, limit: counted.append(data))
    monkeypatch.setattr(pickle_scan, "_PASSED", {})
    pickle_scan.check_opcodes(PROTO + b"K\x01\x85q\x00N0h\x00.")  # one heavy get: cleared
    assert counted == []
    for before in (b"(", b"N0", b"h\x00", b"q\x05"):
        data = PROTO + b"K\x01\x85q\x00" + before + b"q\x01."
        pickle_scan.check_opcodes(data)
        assert counted[-1:] == [data], before
    with pytest.raises(FileProblem, match="GLOBAL"):
        pickle_scan.check_opcodes(PROTO + b"cfoo.")
