//! The seed's example pipeline: intake, extract, feasibility, calculate.
