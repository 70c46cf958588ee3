"""The undo ledger (``moewire.patches``): every patch recorded once, every original back."""

from __future__ import annotations

import gc
import types

import pytest

from moewire import patches


@pytest.fixture(autouse=True)
def empty_ledger():
    patches.undo_all()
    yield
    patches.undo_all()


def _module() -> types.ModuleType:
    module = types.ModuleType("moewire_test_target")
    module.fn = lambda: "original"
    return module


def test_undo_puts_the_first_original_back_after_two_patches():
    """Break: record the original on every patch: the second patch's original is the
    first replacement, and undo leaves it."""
    module = _module()
    original = module.fn
    patches.patch_attr(module, "fn", lambda: "first")
    patches.patch_attr(module, "fn", lambda: "second")
    assert module.fn() == "second"
    assert patches.undo_all() == 1
    assert module.fn is original
    assert patches.active_patches() == []


def test_an_attribute_that_was_not_there_is_deleted():
    """Break: restore a missing attribute as None: it would stay on the object."""
    module = _module()
    patches.patch_attr(module, "added", 1)
    patches.undo_all()
    assert not hasattr(module, "added")


def test_an_inherited_attribute_is_removed_from_the_subclass_only():
    class Base:
        def load(self):
            return "base"

    class Loader(Base):
        pass

    patches.patch_attr(Loader, "load", lambda self: "patched")
    assert Loader().load() == "patched"
    patches.undo_all()
    assert "load" not in vars(Loader) and Loader().load() == "base"


def test_a_module_class_is_restored():
    class Hooked(types.ModuleType):
        pass

    module = _module()
    patches.patch_class(module, Hooked)
    assert type(module) is Hooked and patches.is_patched(module)
    patches.undo_all()
    assert type(module) is types.ModuleType and not patches.is_patched(module)


def test_a_value_someone_replaced_after_moewire_is_left_alone():
    """Break: restore unconditionally: the later patch (a test's monkeypatch) is lost."""
    module = _module()
    patches.patch_attr(module, "fn", lambda: "moewire")
    mine = lambda: "theirs"  # noqa: E731
    module.fn = mine
    assert patches.undo_all() == 0
    assert module.fn is mine


def test_patching_again_after_someone_replaced_records_their_value_as_the_original():
    """Break: keep the first original: undo would bring back a value that was replaced
    before moewire patched again (a stale namespace)."""
    module = _module()
    patches.patch_attr(module, "fn", lambda: "moewire")
    theirs = lambda: "theirs"  # noqa: E731
    module.fn = theirs
    patches.patch_attr(module, "fn", lambda: "moewire again")
    patches.undo_all()
    assert module.fn is theirs


def test_the_ledger_holds_patched_objects_weakly():
    module = _module()
    patches.patch_attr(module, "fn", lambda: "patched")
    assert len(patches.active_patches()) == 1
    del module
    gc.collect()
    assert patches.active_patches() == []


def test_a_block_patch_is_undone_on_exit_even_after_an_error():
    """Break: restore only on a clean exit: the error would leave the patch (and its ledger
    entry) in place."""
    module = _module()
    original = module.fn
    with pytest.raises(KeyError), patches.patched_attr(module, "fn", lambda: "inside"):
        assert module.fn() == "inside"
        assert patches.is_patched(module, "fn")
        raise KeyError("boom")
    assert module.fn is original
    assert patches.active_patches() == []


def test_a_nested_block_with_the_same_value_leaves_the_outer_one_in_place():
    """Break: undo on every exit: the inner block's exit would restore the original while
    the outer block still runs."""
    module = _module()
    original, inside = module.fn, (lambda: "inside")
    with patches.patched_attr(module, "fn", inside):
        with patches.patched_attr(module, "fn", inside):
            pass
        assert module.fn is inside
    assert module.fn is original


def test_a_block_patch_someone_replaced_inside_is_left_to_them():
    module = _module()
    theirs = lambda: "theirs"  # noqa: E731
    with patches.patched_attr(module, "fn", lambda: "inside"):
        module.fn = theirs
    assert module.fn is theirs
    assert patches.active_patches() == []


def test_a_block_patch_over_a_lasting_patch_gives_that_patch_back():
    """Break: drop the ledger entry on exit: the lasting patch's original would come back
    at the block's end, and ``undo_all`` would no longer know the lasting patch."""
    module = _module()
    original, lasting = module.fn, (lambda: "lasting")
    patches.patch_attr(module, "fn", lasting)
    with patches.patched_attr(module, "fn", lambda: "inside"):
        assert module.fn() == "inside"
    assert module.fn is lasting
    assert patches.undo_all() == 1
    assert module.fn is original
