"""The lade block of a Genie folder built with ``--genie-kv lade``: Genie's lookahead dialog's
window / n-gram / guesses (bundle format: read by the runtime, written by the build)."""

from __future__ import annotations

# a Genie folder built with --genie-kv lade: its graphs mask what Genie's lookahead dialog leaves
# behind (families/genielade.py), and this file holds the dialog's lade block ({"version",
# "window", "ngram", "gcap"}), which genie_config.json cannot carry beside a basic dialog
# (libGenie 1.21's schema refuses it)
LADE = "lade.json"
DIALOGS = ("basic", "lade")
# the build's block unless --genie-lade says otherwise (docs/genie.md measures blocks per task)
DEFAULT = "3,3,3"


def lade_from(text: str) -> dict:
    """"W,N,G" (window, n-gram, guesses) -> the lade block; ValueError where it is not one
    (W, G >= 1; N >= 2: an n-gram of one token guesses nothing) or not one the lade form
    keeps lossless (W 1 with N > 2)."""
    try:
        W, N, G = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r}: window,ngram,guesses, e.g. {DEFAULT}") from None
    if W < 1 or G < 1 or N < 2:
        raise ValueError(f"{text!r}: window and guesses >= 1, ngram >= 2")
    if W == 1 and N > 2:
        # lade's N - 2 warm-up steps are then one chain each, which the lade form's graph
        # cannot tell from accepted text (families/genielade.py): its positions would be wrong
        raise ValueError(f"{text!r}: a window of 1 with ngram > 2 is not lossless on the lade "
                         "form (window >= 2)")
    return {"version": 1, "window": W, "ngram": N, "gcap": G}


def lade_rows(block: dict) -> int:
    """The rows one lookahead step feeds the AR-N graph: the token, the window's W x (N - 1)
    and the guesses' G x (N - 1)."""
    return 1 + (int(block["window"]) + int(block["gcap"])) * (int(block["ngram"]) - 1)
