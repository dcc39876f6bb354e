"""Hashing what a pickle builds: the C unpickler hashes every dict key and set element, and a
tuple's hash is not cached, so a tuple of memoised tuples, each holding the one before twice,
takes 2^depth steps to hash. Each bomb here is deep enough to take seconds on the old reader
(26 links: about 4 s; each link doubles it) and must be refused in well under a second with a
one-line error naming the file; real torch.save files sharing tuples load as before.

A dict also compares a new key with every stored key of an equal hash, and a file can choose
ints' and tuples' hashes: 20,000 keys of one hash took the old reader 4 to 12 s (quadratic),
and are refused the same way; keys of distinct hashes (tuples of ints, big ints, floats) load.
"""

from __future__ import annotations

import zipfile

import pytest
import torch
from hostile_files import (
    PROTO,
    archive,
    colliding_ints,
    colliding_pairs,
    distinct_ints,
    get,
    glob,
    integer,
    long1,
    put,
    text,
)
from test_budget import expect_refused_within_budget

from zeroshard.torchfile import pickle_scan
from zeroshard.torchfile.torch_file import TorchFileError, load_torch_file

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
    no tuple is memoised, the list hides it (the old reader hashed 20 M items). The 5,000
    torch.Size keys are calls' results, which may collide: the count of comparisons refuses
    them before the wrapper would (test_a_torch_size_of_anything_but_ints_is_refused)."""
    hidden = b"](" + b"(" + distinct_ints(4000) + b"t" + b"e" + put(0) + b"0"
    call = glob(qualname) + put(1) + b"0"
    if qualname == "torch.Size":  # the copy as a key
        repeated = get(1) + get(0) + b"\x85R" + b"N"
        data = PROTO + hidden + call + b"}(" + repeated * 5000 + b"u."
    else:
        data = PROTO + hidden + call + b"](" + (get(1) + get(0) + b"\x85R") * 5000 + b"e."
    expect_refused_within_budget(archive(tmp_path / "hidden.pt", data), "hashing")


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
    from zeroshard.torchfile.torch_records import FileProblem

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


# ---- keys of one hash ---------------------------------------------------------------------------
KEYS = 20_000
_INTS = b"".join(map(long1, colliding_ints(KEYS)))
_PAIRS = b"".join(integer(first) + long1(second) + b"\x86" for first, second in colliding_pairs(KEYS))
ALIKE = {  # each puts 20,000 distinct keys of one hash into one container
    "int keys (SETITEMS)": b"}(" + b"".join(long1(k) + b"N" for k in colliding_ints(KEYS)) + b"u",
    "int keys (SETITEM)": b"}" + b"".join(long1(k) + b"Ns" for k in colliding_ints(KEYS)),
    "OrderedDict keys": glob("collections.OrderedDict") + b")R(" + b"".join(long1(k) + b"N" for k in colliding_ints(KEYS)) + b"u",
    "tuple keys": b"}(" + b"".join(integer(a) + long1(b) + b"\x86N" for a, b in colliding_pairs(KEYS)) + b"u",
    "set elements": b"\x8f(" + _INTS + b"\x90",
    "frozenset elements": b"(" + _PAIRS + b"\x91",
    "set() of a list": glob("builtins.set") + b"](" + _INTS + b"e\x85R",
}


def test_the_keys_of_the_bombs_share_one_hash():
    for values in (colliding_ints(KEYS), colliding_pairs(KEYS)):
        assert len(set(map(hash, values))) == 1 and len(values) == KEYS


@pytest.mark.parametrize("case", list(ALIKE))
def test_distinct_keys_of_one_hash_are_refused_before_they_are_compared(tmp_path, case):
    path = archive(tmp_path / "alike.pt", PROTO + ALIKE[case] + b".")
    message = expect_refused_within_budget(path, "of one hash")
    assert "16" in message, message


def test_keys_made_by_calls_count_as_colliding_with_every_key(tmp_path):
    """8,000 torch.Size keys of one hash (the old reader compared them for seconds): a call
    made them, so their values are not in the bytes, and each is counted as compared with
    every key before it: past the budget."""
    size = glob("torch.Size") + put(0) + b"0"
    keys = b"".join(get(0) + b"](" + integer(a) + long1(b) + b"e\x85RN" for a, b in colliding_pairs(8000))
    path = archive(tmp_path / "sizes.pt", PROTO + size + b"}(" + keys + b"u.")
    expect_refused_within_budget(path, "hashing", "comparing")


def _padded(keys: bytes) -> bytes:
    """A dict of ``keys`` beside 3,000 tuples: too many tuple opcodes for the cheap bound,
    so the exact count rebuilds the keys and groups them by hash."""
    tuples = b"](" + b"".join(integer(i) + b"\x85" for i in range(3000)) + b"e"
    return PROTO + b"(" + tuples + b"}(" + keys + b"ut."


@pytest.mark.parametrize("alike", [16, 17])
def test_at_most_16_distinct_keys_of_one_hash_load(tmp_path, alike, monkeypatch):
    counted = []
    original = pickle_scan.hash_steps
    monkeypatch.setattr(pickle_scan, "hash_steps", lambda *a: counted.append(1) or original(*a))
    values = colliding_ints(alike)
    path = archive(tmp_path / "alike.pt", _padded(b"".join(long1(v) + text(str(v)) for v in values)))
    if alike == 16:
        loaded = load_torch_file(path)
        assert loaded[1] == {v: str(v) for v in values}
    else:
        with pytest.raises(TorchFileError, match="more than 16 distinct keys of one hash"):
            load_torch_file(path)
    assert counted == [1]


REAL_KEYS = {  # what a user may key a dict by: distinct hashes, rebuilt from the bytes
    "(layer, expert) pairs": {(layer, expert): float(layer * expert) for layer in range(64) for expert in range(32)},
    "big ints": {1000003**3 * i: i for i in range(2000)},
    "floats": {i / 7: i for i in range(2000)},
    "(name, index) pairs": {(f"layer{layer}", expert): expert for layer in range(64) for expert in range(32)},
    "nested tuples": {((i, (i, -1)), None, True, "x", 1.5, 2**80 + i): i for i in range(2000)},
    "a set of pairs": {"pairs": {(i, -i) for i in range(3000)}},
}


@pytest.mark.parametrize("case", list(REAL_KEYS))
def test_thousands_of_keys_of_distinct_hashes_load(tmp_path, case):
    path = tmp_path / "keys.pt"
    torch.save(REAL_KEYS[case], path)
    assert load_torch_file(path) == REAL_KEYS[case]


@pytest.mark.parametrize("qualname", ["collections.OrderedDict", "deepspeed.utils.tensor_fragment.fragment_address"])
def test_a_state_naming_attributes_by_anything_but_strings_is_refused(tmp_path, qualname):
    """BUILD copies its state into the object's attributes, again for every object a memoised
    state fills: attribute names are strings, whose hashes no file chooses."""
    from zeroshard.deepspeed.checkpoint.pickled import ALLOWED_GLOBALS

    made = b")R" if qualname == "collections.OrderedDict" else b")\x81"
    state = b"}(" + b"".join(long1(k) + b"N" for k in colliding_ints(5)) + b"u"
    path = archive(tmp_path / "state.pt", PROTO + glob(qualname) + made + state + b"b.")
    with pytest.raises(TorchFileError, match="names an attribute by a non-string"):
        load_torch_file(path, ALLOWED_GLOBALS)


def test_keys_of_no_known_value_are_compared_with_every_key_put_after_them(tmp_path):
    """1,500 torch.Size keys sharing the hash of the int 7 (the count charges their comparisons
    with each other, within the budget), then the key 7 put 20,000 times: each put compares it
    with all 1,500 (the old count charged one step each)."""
    size = glob("torch.Size") + put(0) + b"0"
    sizes = b"".join(get(0) + b"](" + integer(a) + long1(b) + b"e\x85RN" for a, b in colliding_pairs(1500, target=7))
    assert hash(tuple(colliding_pairs(1, target=7)[0])) == hash(7)
    path = archive(tmp_path / "after.pt", PROTO + size + b"}(" + sizes + (integer(7) + b"N") * 20_000 + b"u.")
    expect_refused_within_budget(path, "hashing", "comparing")


def _saved_pickles(tmp_path) -> list[bytes]:
    """torch.save pickles sharing tuples among names and floats whose bytes look like gets,
    with more than 256 memo entries (LONG_BINPUT) and globals between the gets."""
    betas = (0.8, 0.99)
    shared = (1, (2, 3))
    values = [
        adam_state(3),
        {"h" * 5 + "hq": [betas] * 4, "torch.h": torch.ones(2), "\x85h": shared, "k": [shared, shared]},
        {f"w{i}h": (float(i) * 1.7e-5, shared, torch.Size([i, 2])) for i in range(300)},
        [{"a": betas, "t": torch.zeros(3)}, {"b": betas}],
    ]
    pickles = []
    for index, value in enumerate(values):
        path = tmp_path / f"{index}.pt"
        torch.save(value, path)
        with zipfile.ZipFile(path) as archive:
            pickles.append(archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl"))))
    return pickles


def test_the_gets_that_start_an_opcode_are_between_the_exact_count_and_the_byte_values(tmp_path):
    """The cheap bound's second count keeps the bytes that look like heavy gets only where an
    opcode starts: never fewer than the opcode pass finds (it would then clear a bomb), never
    more than the byte values."""
    for data in _saved_pickles(tmp_path):
        segments, uncounted = pickle_scan._scan(data)
        puts = pickle_scan._heavy_put_indices(data)
        exact = pickle_scan._heavy_gets(data, segments, puts)
        starting = pickle_scan._heavy_gets_starting_opcodes(data, segments, puts)
        at_most = pickle_scan._heavy_gets_at_most(data, segments, puts)
        assert not uncounted and exact is not None and starting is not None
        assert exact <= starting <= at_most, (exact, starting, at_most)
        assert starting > 0, "the pickles share tuples: a get the count must see"
