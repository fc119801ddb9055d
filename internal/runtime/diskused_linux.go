package runtime

import (
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/runtime/disk"
)

// DiskUsed is what the sandbox's writes take of its disk quota or
// bound, in bytes; 0 without either.
func (sb *Sandbox) DiskUsed() int64 {
	sb.mu.Lock()
	upper := sb.UpperFS
	sb.mu.Unlock()
	if upper != "" {
		return max(disk.UpperUsed(sb.root(), upper), 0)
	}
	var fs unix.Statfs_t
	if mounted, _ := mount.IsMountPoint(disk.Dir(sb.dir)); !mounted || unix.Statfs(disk.Dir(sb.dir), &fs) != nil {
		return 0
	}
	return int64(fs.Blocks-fs.Bfree) * fs.Bsize
}
