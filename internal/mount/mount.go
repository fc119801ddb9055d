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

// EROFSDevices is EROFS for an image that keeps its file data on extra
// devices: the files devices, in the order of the image's device table.
func EROFSDevices(image string, devices []string) Mount {
	m := EROFS(image)
	for _, d := range devices {
		m.Options = append(m.Options, "device="+d)
	}
	return m
}

// Overlay describes the composition of a sandbox's root: read-only
// lowers, topmost first (toolkit, workspace, base, with snapshot diffs
// above the layer they were taken on), and a writable upper with its
// work directory on the same file system. Redirects and metacopy stay
// off: a directory rename in the merged view returns EXDEV and tools copy
// instead, and the upper holds whole files, so it can be packed into a
// layer as it is.
func Overlay(lowers []string, upper, work string) Mount {
	opts := []string{"lowerdir=" + escapeLowers(lowers)}
	if upper != "" {
		opts = append(opts, "upperdir="+upper, "workdir="+work)
	}
	opts = append(opts, overlayFlags...)
	return Mount{Type: "overlay", Source: "overlay", Options: opts}
}

// overlayFlags are every dsec overlay's options beyond its layers: no
// feature that writes what an older kernel or a snapshot reader would
// misread.
var overlayFlags = []string{"redirect_dir=off", "metacopy=off", "index=off", "xino=off"}

// escapeLowers joins lower directories, escaping the separator.
func escapeLowers(ls []string) string {
	esc := make([]string, len(ls))
	for i, l := range ls {
		esc[i] = strings.NewReplacer(`\`, `\\`, ":", `\:`, ",", `\,`).Replace(l)
	}
	return strings.Join(esc, ":")
}
