"""Project logger records carry the component and the process index."""

from __future__ import annotations

import io

from meshrl.utils import log


def test_record_carries_component_and_process_index():
    stream = io.StringIO()
    log.setup("INFO", stream=stream)
    try:
        log.set_process_index(3)
        log.get_logger("trainer").info("step %d", 7)
    finally:
        log.set_process_index(0)
    line = stream.getvalue()
    assert "[p3 trainer] step 7" in line


def test_setup_is_idempotent():
    stream = io.StringIO()
    log.setup("INFO", stream=stream)
    log.setup("INFO", stream=stream)
    log.get_logger("mesh").warning("once")
    assert stream.getvalue().count("once") == 1


def test_third_party_info_is_hidden_unless_debug():
    import logging

    from absl import logging as absl_logging

    try:
        log.setup("INFO", stream=io.StringIO())
        assert not logging.getLogger("orbax").isEnabledFor(logging.INFO)
        assert not logging.getLogger("absl").isEnabledFor(logging.INFO)
        assert absl_logging.get_verbosity() == absl_logging.WARNING
        assert logging.getLogger("absl").isEnabledFor(logging.WARNING)

        log.setup("DEBUG", stream=io.StringIO())
        assert logging.getLogger("orbax").isEnabledFor(logging.INFO)
        assert absl_logging.get_verbosity() == absl_logging.INFO
    finally:
        log.setup("INFO", stream=io.StringIO())
