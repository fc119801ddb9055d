package vm

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	diskfs "github.com/diskfs/go-diskfs"
	"github.com/diskfs/go-diskfs/backend/file"
	"github.com/diskfs/go-diskfs/partition/gpt"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// ImportOptions are an import's: the file's format ("": qemu-img's
// probe), whether to install the agent, and whether the tag may move
// from another VM image.
type ImportOptions struct {
	Format  string
	NoAgent bool
	Force   bool
}

// Import makes a VM image of an existing disk image, a raw or qcow2
// file: its bytes as they are, stored as qcow2. Where its GPT has an
// ext4 root file system with systemd, dsec's agent's units are
// installed there as a build does (unless o.NoAgent), so that the vm
// backend runs it; an image without them is stored, and refused by the
// backend until it has them. A qcow2 file that reads another file (a
// backing file, an external data file) or is encrypted is refused: the
// store keeps whole disks, and a crafted image must not read the host's
// files.
func Import(ctx context.Context, s *store.Store, path string, ref layer.Ref, o ImportOptions) (*Image, error) {
	info, err := probe(ctx, path, o.Format)
	if err != nil {
		return nil, err
	}
	release, err := s.Writer()
	if err != nil {
		return nil, err
	}
	defer release()
	if err := checkTag(ctx, s, ref, o.Force); err != nil {
		return nil, err
	}
	// Read as raw beside the store's ingests (dsec layer gc removes one
	// a killed import left): the partitions are read and the agent
	// written there, then stored as qcow2.
	raw, err := os.CreateTemp(filepath.Join(s.Dir(), "ingest"), "blob.*.raw")
	if err != nil {
		return nil, err
	}
	raw.Close()
	defer os.Remove(raw.Name())
	if err := qemuImg(ctx, "convert", "-q", "-f", info.Format, "-O", "raw", path, raw.Name()); err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	d, err := readDisk(raw.Name(), info.Size)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if d.Root.Size > 0 {
		dev := fmt.Sprintf("%s?offset=%d", raw.Name(), d.Root.Offset)
		exists := func(p string) bool { return debugfsExists(ctx, dev, p) }
		d.OS = osName(ctx, dev)
		switch {
		case exists("etc/systemd/system/dsec-agent.service") && exists("etc/systemd/system/run-dsec-agent.mount"):
			d.Agent = AgentSystemd // a disk dsec built, or imported before
		case o.NoAgent || !(exists("usr/lib/systemd/systemd") || exists("lib/systemd/systemd")):
		default:
			if err := installAgent(ctx, raw.Name(), d.Root, exists); err != nil {
				return nil, err
			}
			d.Agent = AgentSystemd
		}
	}
	blob, err := storeRaw(ctx, s, raw.Name())
	if err != nil {
		return nil, err
	}
	abs, _ := filepath.Abs(path)
	rec := Record{Created: time.Now().UTC(), Source: "import of " + abs, Disk: d}
	return record(ctx, s, ref, []ocispec.Descriptor{blob}, nil, rec, o.Force)
}

// imageInfo is what qemu-img says of a disk image.
type imageInfo struct {
	Format   string `json:"format"`
	Size     int64  `json:"virtual-size"`
	Backing  string `json:"backing-filename"`
	Crypted  bool   `json:"encrypted"`
	Specific struct {
		Data struct {
			DataFile string `json:"data-file"`
		} `json:"data"`
	} `json:"format-specific"`
}

// probe is what the disk image at path is, refused unless it is a raw or
// qcow2 disk that reads nothing but itself.
func probe(ctx context.Context, path, format string) (imageInfo, error) {
	var info imageInfo
	switch format {
	case "", "raw", "qcow2":
	default:
		return info, fmt.Errorf("format %q: dsec imports raw and qcow2 disks (convert others with qemu-img convert): %w", format, errdefs.ErrInvalidArgument)
	}
	if st, err := os.Stat(path); err != nil {
		return info, fmt.Errorf("no disk image %s: give a raw or qcow2 file: %w", path, errdefs.ErrNotFound)
	} else if !st.Mode().IsRegular() {
		return info, fmt.Errorf("%s is not a file: give a raw or qcow2 disk image: %w", path, errdefs.ErrInvalidArgument)
	}
	args := []string{"info", "--output=json", "-U"}
	if format != "" {
		args = append(args, "-f", format)
	}
	out, err := exec.CommandContext(ctx, "qemu-img", append(args, path)...).CombinedOutput()
	if errors.Is(err, exec.ErrNotFound) {
		return info, fmt.Errorf("qemu-img is missing: install qemu-utils (make deps does)")
	}
	if err != nil || json.Unmarshal(out, &info) != nil {
		return info, fmt.Errorf("%s is no disk image qemu-img reads: %s: %w", path, strings.TrimSpace(string(out)), errdefs.ErrInvalidArgument)
	}
	switch {
	case info.Format != "raw" && info.Format != "qcow2":
		return info, fmt.Errorf("%s is a %s disk: dsec imports raw and qcow2 (qemu-img convert -O qcow2 makes one): %w", path, info.Format, errdefs.ErrInvalidArgument)
	case info.Backing != "":
		return info, fmt.Errorf("%s reads a backing file (%s): give the whole disk (qemu-img convert -O qcow2 flattens it): %w", path, info.Backing, errdefs.ErrInvalidArgument)
	case info.Specific.Data.DataFile != "":
		return info, fmt.Errorf("%s keeps its data in another file (%s): give the whole disk (qemu-img convert -O qcow2): %w", path, info.Specific.Data.DataFile, errdefs.ErrInvalidArgument)
	case info.Crypted:
		return info, fmt.Errorf("%s is encrypted: give a disk dsec can read: %w", path, errdefs.ErrInvalidArgument)
	case info.Size <= 0 || info.Size > MaxSize:
		return info, fmt.Errorf("%s is a disk of %d bytes: give one of at most %s: %w", path, info.Size, mibs(MaxSize), errdefs.ErrInvalidArgument)
	}
	return info, nil
}

// qemuImg runs qemu-img with args.
func qemuImg(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "qemu-img", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// GPT partition types.
const (
	typeESP       = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
	typeRootX8664 = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"
	typeLinuxData = "0FC63DAF-8483-4772-8E79-3D69DE4772E4"
)

// readDisk is the disk at path as its GPT says: its ESP, and its root,
// an ext4 file system (a partition typed root x86-64 before the largest
// of Linux data). A disk without a GPT is refused: it boots through
// UEFI from one.
func readDisk(path string, size int64) (Disk, error) {
	f, err := os.Open(path)
	if err != nil {
		return Disk{}, err
	}
	dk, err := diskfs.OpenBackend(file.New(f, true))
	if err != nil {
		f.Close()
		return Disk{}, err
	}
	defer dk.Close()
	t, err := dk.GetPartitionTable()
	table, ok := t.(*gpt.Table)
	if err != nil || !ok {
		return Disk{}, fmt.Errorf("no GPT partition table: a full VM boots through UEFI from a GPT disk: %w", errdefs.ErrInvalidArgument)
	}
	d := Disk{Size: size}
	ss := int64(table.LogicalSectorSize)
	if ss == 0 {
		ss = sector
	}
	var root *gpt.Partition
	for _, p := range table.Partitions {
		if p == nil || p.Start == 0 || p.Size == 0 {
			continue
		}
		switch strings.ToUpper(string(p.Type)) {
		case typeESP:
			if d.ESP.Size == 0 {
				d.ESP = Partition{Offset: int64(p.Start) * ss, Size: int64(p.Size), UUID: strings.ToLower(p.GUID)}
			}
		case typeRootX8664, typeLinuxData:
			if !isExt4(f, int64(p.Start)*ss) {
				continue
			}
			better := root == nil || strings.ToUpper(string(root.Type)) != typeRootX8664 &&
				(strings.ToUpper(string(p.Type)) == typeRootX8664 || p.Size > root.Size)
			if better {
				root = p
			}
		}
	}
	if d.ESP.Size == 0 {
		return Disk{}, fmt.Errorf("no EFI system partition: a full VM boots through UEFI from one: %w", errdefs.ErrInvalidArgument)
	}
	if root != nil {
		d.Root = Partition{Offset: int64(root.Start) * ss, Size: int64(root.Size), UUID: strings.ToLower(root.GUID)}
	}
	return d, nil
}

// isExt4 says whether an ext2/3/4 superblock is at off of f.
func isExt4(f *os.File, off int64) bool {
	var magic [2]byte
	if _, err := f.ReadAt(magic[:], off+1024+56); err != nil {
		return false
	}
	return binary.LittleEndian.Uint16(magic[:]) == 0xEF53
}

// debugfsExists says whether the ext4 file system dev holds path.
func debugfsExists(ctx context.Context, dev, path string) bool {
	cmd := exec.CommandContext(ctx, "debugfs", "-R", "stat /"+path, dev)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	return cmd.Run() == nil && !strings.Contains(stderr.String(), "File not found")
}

// osName is the PRETTY_NAME of the os-release of the file system dev.
func osName(ctx context.Context, dev string) string {
	for _, p := range []string{"/usr/lib/os-release", "/etc/os-release"} {
		out, err := exec.CommandContext(ctx, "debugfs", "-R", "cat "+p, dev).Output()
		if err != nil {
			continue
		}
		for line := range strings.Lines(string(out)) {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "PRETTY_NAME="); ok {
				return strings.Trim(v, `"'`)
			}
		}
	}
	return ""
}
