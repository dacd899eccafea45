"""Reproduction cards: a card's study run and judged (``card_run``), its values with the run as the
unit (``card_units``), its report, figure and pilot (``card_report``, ``card_figure``, ``pilot``), and
the code its numbers go through (``numerics_paths``)."""
