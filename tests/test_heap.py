"""The cycle collector's settings during runs and for a serving process (workbench.utils.heap)."""

import gc

from workbench.utils.heap import freeze_startup_heap, frozen_heap, rare_collections


def test_a_run_freezes_the_heap_and_gives_it_back():
    gc.unfreeze()  # whatever an earlier test left frozen (harmless: back to the oldest generation)
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_heap():  # nested: the outer freeze stands
            assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0


def test_refreeze_moves_what_the_run_kept_out_of_the_collectors_way_until_the_run_ends():
    gc.unfreeze()
    with frozen_heap() as refreeze:
        at_entry = gc.get_freeze_count()
        kept = [[i] for i in range(1000)]  # a run's records: tracked containers
        assert gc.get_freeze_count() == at_entry
        refreeze()
        assert gc.get_freeze_count() >= at_entry + 1000
    assert gc.get_freeze_count() == 0 and gc.is_tracked(kept[0])


def test_refreeze_leaves_someone_elses_freeze_alone():
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        with frozen_heap() as refreeze:
            kept = [[i] for i in range(100)]
            refreeze()  # not this run's freeze: nothing moves
            assert gc.get_freeze_count() == frozen and len(kept) == 100
    finally:
        gc.unfreeze()


def test_rare_collections_restores_the_thresholds():
    before = gc.get_threshold()
    with rare_collections(12345):
        assert gc.get_threshold()[0] == 12345
    assert gc.get_threshold() == before


def test_a_server_freezes_what_start_up_left_and_a_run_inside_it_changes_nothing():
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_heap():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen  # still frozen after the run
    finally:
        gc.unfreeze()
