package runtime

// SetNoDevices makes new groups without the device allowlist (true), for
// BenchmarkDevices' baseline.
func SetNoDevices(on bool) { noDevices = on }
