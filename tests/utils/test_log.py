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
