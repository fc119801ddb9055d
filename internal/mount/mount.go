// Package mount describes mounts as values and is the one place that
// calls mount(2). Other packages build a Mount and hand it here.
package mount

import (
	"fmt"
	"strings"
)

// Mount is a serialized mount(2) call.
type Mount struct {
	Type    string   // file system type: erofs, overlay, ...
	Source  string   // a file for erofs: mounted file-backed, no loop device
	Options []string // "ro" and flag words are turned into flags; the rest is data
}

func (m Mount) String() string {
	return fmt.Sprintf("%s %s (%s)", m.Type, m.Source, strings.Join(m.Options, ","))
}

// EROFS describes a read-only, file-backed EROFS mount of image.
func EROFS(image string) Mount {
	return Mount{Type: "erofs", Source: image, Options: []string{"ro", "nodev", "nosuid"}}
}
