"""The cycle collector's settings during runs and for a serving process (workbench.utils.heap).

The collector's state is global to a process, and other tests may leave threads that run the
engine, so each check runs in a fresh interpreter."""

import subprocess
import sys
import textwrap


def run_fresh(code: str) -> None:
    program = "import gc\nfrom workbench.utils.heap import freeze_startup_heap, frozen_heap, rare_collections\n"
    done = subprocess.run([sys.executable, "-c", program + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_run_freezes_the_heap_and_gives_it_back():
    run_fresh("""
        assert gc.get_freeze_count() == 0
        with frozen_heap():
            frozen = gc.get_freeze_count()
            assert frozen > 0
            with frozen_heap():  # nested: the outer freeze stands
                assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == 0
    """)


def test_refreeze_moves_what_the_run_kept_out_of_the_collectors_way_until_the_run_ends():
    run_fresh("""
        with frozen_heap() as refreeze:
            at_entry = gc.get_freeze_count()
            kept = [[i] for i in range(1000)]  # a run's records: tracked containers
            assert gc.get_freeze_count() == at_entry
            refreeze()
            assert gc.get_freeze_count() >= at_entry + 1000
        assert gc.get_freeze_count() == 0 and gc.is_tracked(kept[0])
    """)


def test_refreeze_leaves_someone_elses_freeze_alone():
    run_fresh("""
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        with frozen_heap() as refreeze:
            kept = [[i] for i in range(100)]
            refreeze()  # not this run's freeze: nothing moves
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen  # the server's freeze stands after the run
    """)


def test_rare_collections_restores_the_thresholds():
    run_fresh("""
        before = gc.get_threshold()
        with rare_collections(12345):
            assert gc.get_threshold()[0] == 12345
        assert gc.get_threshold() == before
    """)
