"""Engine: the step loop, output processing and the offline / async front ends."""
