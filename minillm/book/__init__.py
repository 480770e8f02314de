"""The book's own layer: notebook setup (``setup``, ``saved_results``), exercise generation
(``exercises``) and the exercise checkers (``checks``, one module per chapter).

    from minillm.book import setup
    ctx = setup()   # device, scale, seeds, plot style, and one line naming the hardware
"""

from .notebook import BookContext, saved_results, setup

__all__ = ["BookContext", "saved_results", "setup"]
