package runtime

import "github.com/dsec-project/dsec/internal/runtime/driver"

// SetNoDevices makes new groups without the device allowlist (true), for
// BenchmarkDevices' baseline.
func SetNoDevices(on bool) { driver.NoDevices = on }
