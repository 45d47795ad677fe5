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
