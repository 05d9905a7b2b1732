"""A request's intake steps run side by side (its images' fetches, decodes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def all_or_none(*steps: Awaitable[Any]) -> list[Any]:
    """Every step's result, in order, as `asyncio.gather` gives them; but the first failure
    cancels the other steps, and waits for them to end, before it is raised. `gather` leaves
    them running: a request refused for one bad image kept fetching its others, holding their
    share of the memory budget, long after its answer had gone."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        raise
