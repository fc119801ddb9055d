package runtime

import (
	"errors"

	"github.com/dsec-project/dsec/internal/feature"
	"github.com/dsec-project/dsec/internal/runtime/disk"
)

// OnlineGrow is growing a mounted disk quota, which takes
// CAP_SYS_RESOURCE (package feature).
var OnlineGrow = feature.New("online disk grow", "a running sandbox's disk quota grows only once it is stopped and started (offline)", func() error {
	if !disk.HasCapSysResource() {
		return errors.New("the worker lacks CAP_SYS_RESOURCE")
	}
	return nil
})
