"""Every plot and drawing of the book, by chapter topic; the only part of minillm that imports
matplotlib. Functions take result dicts or objects the other layers made and return a figure.
"""
