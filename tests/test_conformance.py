"""accel against accelerate==1.15.0: each public name of the scope is covered (same parameter names, positions
and defaults, checked with `inspect`) or excluded with a reason, as listed in tests/data/conformance.toml."""

import pathlib
import sys

import conformance
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a test dependency there)
    import tomli as tomllib

DATA = tomllib.loads((pathlib.Path(__file__).parent / "data" / "conformance.toml").read_text())
REASONS = DATA["reasons"]
SCOPES = [*conformance.MODULES, conformance.ACCELERATOR]


def _cases():
    for scope in SCOPES:
        entry = DATA[scope]
        for name in entry["covered"]:
            marks = []
            if name in entry.get("pending", {}):
                marks.append(pytest.mark.xfail(strict=True, reason=entry["pending"][name]))
            yield pytest.param(scope, name, marks=marks, id=f"{scope}:{name}")


@pytest.mark.parametrize("scope", SCOPES)
def test_every_name_is_covered_or_excluded(scope):
    entry = DATA[scope]
    covered, excluded = set(entry["covered"]), set(entry["excluded"])
    assert not covered & excluded, "a name is both covered and excluded"
    peer = set(conformance.peer_names(scope))
    assert peer - covered - excluded == set(), "names of accelerate==1.15.0 not sorted in tests/data/conformance.toml"
    assert (covered | excluded) - peer == set(), "names listed that accelerate==1.15.0 does not have"
    for table in ("differs", "pending"):
        assert set(entry.get(table, {})) <= covered, f"{table} lists names that are not covered"


@pytest.mark.parametrize("scope", SCOPES)
def test_excluded_names_are_really_absent(scope):
    """A name accel now offers must move from `excluded` to `covered`, so that its signature gets checked."""
    offered = []
    for name in DATA[scope]["excluded"]:
        try:
            conformance.resolve(scope, name, ours=True)
        except AttributeError:
            continue
        offered.append(name)
    assert offered == []


@pytest.mark.parametrize("scope", SCOPES)
def test_every_exclusion_says_why(scope):
    for name, reason in DATA[scope]["excluded"].items():
        text = REASONS.get(reason, reason)
        assert len(text.split()) >= 4, f"{scope}.{name}: say why it is excluded (a [reasons] key or a sentence)"
    for name, difference in DATA[scope].get("differs", {}).items():
        assert len(REASONS.get(difference["reason"], difference["reason"]).split()) >= 4, f"{scope}.{name}"


@pytest.mark.parametrize(("scope", "name"), list(_cases()))
def test_covered_name_matches_accelerate(scope, name):
    peer = conformance.resolve(scope, name, ours=False)
    try:
        ours = conformance.resolve(scope, name, ours=True)
    except AttributeError:
        pytest.fail(f"{name} is missing from {conformance.MODULES.get(scope, 'accel.Accelerator')}")
    ignore = DATA[scope].get("differs", {}).get(name, {}).get("ignore", [])
    assert conformance.signature_differences(peer, ours, ignore) == []
    if ignore:
        # A recorded difference that no longer exists must be removed from the data file (and docs/compat.md).
        assert conformance.signature_differences(peer, ours) != [], f"{name} now matches: drop it from `differs`"


def _skip_loaders():
    from accelerate.data_loader import SkipDataLoader as PeerSkip

    from accel.data_loader import SkipDataLoader

    data = list(range(8))
    return SkipDataLoader(data, skip_batches=1, batch_size=2), PeerSkip(data, skip_batches=1, batch_size=2)


def test_skip_data_loader_and_its_state_flags():
    """Attributes that only exist on instances: `DataLoaderStateMixin`'s flags."""
    from accel.data_loader import DataLoaderStateMixin

    ours, theirs = _skip_loaders()
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs] == [[2, 3], [4, 5], [6, 7]]
    assert isinstance(ours, DataLoaderStateMixin)
    for flag in ("end_of_dataloader", "remainder"):
        assert hasattr(ours, flag) and hasattr(theirs, flag)


def test_skip_data_loader_base_dataloader_is_the_loader_inside():
    ours, theirs = _skip_loaders()
    assert [b.tolist() for b in theirs.base_dataloader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [b.tolist() for b in ours.base_dataloader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_rules_catch_differences():
    """The comparison itself fails where a drop-in would break."""

    def peer(a, b=1, *, c="x", **kwargs): ...

    def renamed(a, bb=1, *, c="x", **kwargs): ...

    def other_default(a, b=2, *, c="x", **kwargs): ...

    def no_kwargs(a, b=1, *, c="x"): ...

    def required_extra(a, b=1, d=None, *, c="x", e, **kwargs): ...

    def wider(a=0, b=1.0, d=None, *, c="x", **kwargs): ...

    assert conformance.signature_differences(peer, renamed)
    assert conformance.signature_differences(peer, other_default)
    assert conformance.signature_differences(peer, no_kwargs)
    assert conformance.signature_differences(peer, required_extra)
    assert conformance.signature_differences(peer, wider) == []


def test_decorated_peer_functions_are_compared_by_the_function_inside():
    def hiding(function):
        def _inner(*args, **kwargs):
            return function(*args, **kwargs)

        return _inner

    @hiding
    def peer(project_name, config=None): ...

    def same(project_name, config=None): ...

    def other(name, config=None): ...

    assert conformance.signature_differences(peer, same) == []
    assert conformance.signature_differences(peer, other)
