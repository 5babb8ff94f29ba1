# SPDX-License-Identifier: Apache-2.0
"""Rows of a device table lent to requests: the one pool class."""


class SlotPool:
    """Rows ``1 .. size - 1`` of one device table (row 0 is never lent: an
    unarmed entry's slot, kept zero), lent per request while it is resident.

    The pool owns who holds what (:meth:`rows_of`): a request whose rows were
    taken back (given back, or evicted to make room) holds none, so its
    owner uploads it again before it is armed, and never arms rows that
    another request's values now fill.
    """

    def __init__(self, size: int, what: str, hint: str = ""):
        self.free = list(range(size - 1, 0, -1))
        self.holders: dict[str, list[int]] = {}
        self.what = what
        self.hint = hint

    def rows_of(self, req_id: str) -> list[int] | None:
        """The rows ``req_id`` holds (possibly none: it needed none), None
        when it holds no lease."""
        return self.holders.get(req_id)

    def lend(self, req_id: str, need: int, batch: set[str]) -> list[int]:
        """``need`` rows for ``req_id``; when too few are free, holders not
        in ``batch`` (the step's requests) give theirs back first.
        RuntimeError when the batch alone needs more than the table has."""
        if len(self.free) < need:
            for other_id in [r for r in self.holders if r not in batch]:
                self.give_back(other_id)
                if len(self.free) >= need:
                    break
        if len(self.free) < need:
            hint = f"; {self.hint}" if self.hint else ""
            raise RuntimeError(
                f"vllm-hidden-states: {self.what} full ({need} asked, {len(self.free)} free){hint}"
            )
        rows = [self.free.pop() for _ in range(need)]
        self.holders[req_id] = rows
        return rows

    def give_back(self, req_id: str) -> None:
        rows = self.holders.pop(req_id, None)
        if rows is not None:
            self.free.extend(rows)
