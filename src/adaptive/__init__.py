"""The adaptive compression controller and its settings: the event stream in, rho and S_max out."""
