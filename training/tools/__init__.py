"""Tools a user runs by hand: planner, plots, Ascend acceptance kit, exports, checkpoint re-layout."""
