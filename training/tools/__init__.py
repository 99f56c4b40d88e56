"""Tools a user runs by hand: the planner (`planner`, its device table `devices`, its printed form `plan_report`),
plots, the Ascend acceptance kit, exports, checkpoint re-layout."""
