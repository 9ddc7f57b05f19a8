//! Load assignment: weights to slot tables.
