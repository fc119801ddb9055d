package vm

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

// fakeTree is a tree with what a disk image needs to be built (not to
// boot): a kernel and initramfs of each version, and systemd-boot.
func fakeTree(t *testing.T, versions ...string) string {
	t.Helper()
	tree := t.TempDir()
	files := map[string]string{LoaderPath: "MZ loader", "etc/hostname": "vm\n", "sbin/init": "init",
		"usr/lib/os-release": "NAME=Test\nPRETTY_NAME=\"Test OS 1\"\n"}
	for _, v := range versions {
		files["boot/vmlinuz-"+v] = "MZ kernel " + v
		files["boot/initrd.img-"+v] = "initrd " + v
	}
	for p, s := range files {
		if err := os.MkdirAll(filepath.Join(tree, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(tree, p), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return tree
}

func TestCompareVersions(t *testing.T) {
	for _, c := range []struct {
		a, b string
		want int
	}{
		{"6.1.0-50-amd64", "6.1.0-9-amd64", 1},
		{"6.10.0-1-amd64", "6.9.0-1-amd64", 1},
		{"6.1.0-50-amd64", "6.1.0-50-amd64", 0},
		{"6.1.0-50-amd64", "6.1.0-50-cloud-amd64", -1},
		{"5.10.0-0", "6.1.0-0", -1},
	} {
		if got := compareVersions(c.a, c.b); got != c.want || compareVersions(c.b, c.a) != -c.want {
			t.Errorf("compare(%s, %s) = %d, want %d", c.a, c.b, got, c.want)
		}
	}
}

// TestBuildDiskRefuses: a tree that cannot boot, or a size that cannot
// hold it, is refused with what to do, and the file is left as it was.
func TestBuildDiskRefuses(t *testing.T) {
	noLoader := fakeTree(t, "6.1.0-1-amd64")
	os.Remove(filepath.Join(noLoader, LoaderPath))
	noInitrd := fakeTree(t, "6.1.0-1-amd64")
	os.Remove(filepath.Join(noInitrd, "boot/initrd.img-6.1.0-1-amd64"))
	noInit := fakeTree(t, "6.1.0-1-amd64")
	os.Remove(filepath.Join(noInit, "sbin/init"))
	textKernel := fakeTree(t, "6.1.0-1-amd64")
	os.WriteFile(filepath.Join(textKernel, "boot/vmlinuz-6.1.0-1-amd64"), []byte("not a kernel"), 0o644)
	// A tree's links lead nowhere out of it: the host's file would go
	// onto the disk (a tenant's layer may be such a tree).
	hostInitrd := fakeTree(t, "6.1.0-1-amd64")
	os.Remove(filepath.Join(hostInitrd, "boot/initrd.img-6.1.0-1-amd64"))
	os.Symlink("/etc/hostname", filepath.Join(hostInitrd, "boot/initrd.img-6.1.0-1-amd64"))
	hostLoader := fakeTree(t, "6.1.0-1-amd64")
	os.Remove(filepath.Join(hostLoader, LoaderPath))
	os.Symlink("../../../../../../../../../usr/bin/true", filepath.Join(hostLoader, LoaderPath))
	for _, c := range []struct {
		name, tree string
		o          DiskOptions
		want       string
	}{
		{"no kernel", fakeTree(t), DiskOptions{}, "linux-image-amd64"},
		{"a kernel without its initramfs", noInitrd, DiskOptions{}, "linux-image-amd64"},
		{"no loader", noLoader, DiskOptions{}, "systemd-boot-efi"},
		{"not a directory", "/etc/hostname", DiskOptions{}, "not a directory"},
		{"no init", noInit, DiskOptions{}, "systemd-sysv"},
		{"a kernel that is no PE image", textKernel, DiskOptions{}, "no UEFI (PE) image"},
		{"an initramfs that is a host's file", hostInitrd, DiskOptions{}, "linux-image-amd64"},
		{"a loader that is a host's file", hostLoader, DiskOptions{}, "systemd-boot-efi"},
		{"a kernel parameter with a space", fakeTree(t, "6.1.0-1-amd64"), DiskOptions{KernelArgs: []string{"a b"}}, "without spaces"},
		{"an empty kernel parameter", fakeTree(t, "6.1.0-1-amd64"), DiskOptions{KernelArgs: []string{""}}, "without spaces"},
		{"a disk too large", fakeTree(t, "6.1.0-1-amd64"), DiskOptions{Size: MaxSize + 1}, "at most"},
		{"an ESP too small", fakeTree(t, "6.1.0-1-amd64"), DiskOptions{ESPSize: 32 << 20}, "at least 64 MiB"},
		{"no such directory", filepath.Join(t.TempDir(), "nosuch"), DiskOptions{}, "no directory"},
		{"a disk too small", fakeTree(t, "6.1.0-1-amd64"), DiskOptions{Size: 300 << 20}, "give at least"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f, err := os.Create(filepath.Join(t.TempDir(), "disk"))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			_, err = BuildDisk(context.Background(), c.tree, f, c.o)
			if !errdefs.IsInvalidArgument(err) && !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("%v, want an invalid argument that says %q", err, c.want)
			}
			if st, _ := f.Stat(); st.Size() != 0 {
				t.Fatalf("the refused build wrote %d bytes", st.Size())
			}
		})
	}
}

// TestImages: a VM image is built into the store under a tag of its
// own kind, which the layer commands neither list nor take; its tag
// moves only with force and never from a layer; removed, its disk goes
// at the next collection.
func TestImages(t *testing.T) {
	ctx := context.Background()
	s, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tree := fakeTree(t, "6.1.0-9-amd64", "6.1.0-50-amd64")
	ref := must(layer.ParseRef("desktop:1"))
	img, err := Build(ctx, s, []string{tree}, ref, BuildOptions{DiskOptions: DiskOptions{Seed: "x", KernelArgs: []string{"quiet"}, Size: 400 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	d := img.Disk
	if d.Kernel != "6.1.0-50-amd64" || d.OS != "Test OS 1" || d.ESP.Offset != 1<<20 || d.Root.Offset != d.ESP.Offset+DefaultESPSize ||
		d.Root.Offset+d.Root.Size != d.Size-(1<<20) || d.Cmdline != "root=PARTUUID="+d.Root.UUID+" rw console=tty0 console=ttyS0 quiet" {
		t.Fatalf("disk %+v", d)
	}
	if d.Root.UUID != uuidOf("x", "root") || d.Root.UUID == d.ESP.UUID {
		t.Fatalf("GUIDs %s %s not those of the seed", d.ESP.UUID, d.Root.UUID)
	}
	// Stored as qcow2 of the disk's size, taking what its partitions hold.
	out, err := exec.Command("qemu-img", "info", "--output=json", img.Path).Output()
	if err != nil || !strings.Contains(string(out), `"format": "qcow2"`) || !strings.Contains(string(out), fmt.Sprintf(`"virtual-size": %d,`, d.Size)) {
		t.Fatalf("the disk blob: %v %s", err, out)
	}
	if st, err := os.Stat(img.Path); err != nil || img.Path != s.BlobPath(img.Blob.Digest) || img.Blob.MediaType != MediaTypeDisk || st.Size() > d.Size/4 {
		t.Fatalf("the disk blob: %+v %v", img.Blob, err)
	}
	got, err := Lookup(ctx, s, "desktop:1")
	if err != nil || got.ID != img.ID || got.Disk != d {
		t.Fatalf("lookup: %+v %v", got, err)
	}
	if imgs, err := List(ctx, s); err != nil || len(imgs) != 1 || imgs[0].Tag != "desktop:1" {
		t.Fatalf("list: %v %v", imgs, err)
	}
	if ls, err := layer.List(ctx, s); err != nil || len(ls) != 0 {
		t.Fatalf("the layers listed: %v %v", ls, err)
	}
	if _, err := layer.Resolve(ctx, s, "desktop:1"); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "VM image") {
		t.Fatalf("a VM image named as a layer: %v", err)
	}
	if _, err := Build(ctx, s, []string{tree}, ref, BuildOptions{}); !errdefs.IsAlreadyExists(err) || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("built again without force: %v", err)
	}
	again, err := Build(ctx, s, []string{tree}, ref, BuildOptions{Force: true, DiskOptions: DiskOptions{Size: 400 << 20}})
	if err != nil || again.ID == img.ID {
		t.Fatalf("built again with force: %+v %v", again, err)
	}
	// A layer's tag is never taken.
	lt := t.TempDir()
	os.WriteFile(filepath.Join(lt, "f"), []byte("x"), 0o644)
	if _, err := layer.Build(ctx, s, layer.BuildOptions{Source: lt, Ref: must(layer.ParseRef("base:1")), Kind: layer.KindBase}); err != nil {
		t.Fatal(err)
	}
	if _, err := Build(ctx, s, []string{tree}, must(layer.ParseRef("base:1")), BuildOptions{Force: true}); !errdefs.IsAlreadyExists(err) || !strings.Contains(err.Error(), "base layer") {
		t.Fatalf("a layer's tag: %v", err)
	}
	if _, err := Lookup(ctx, s, "base:1"); !errdefs.IsNotFound(err) {
		t.Fatalf("a layer looked up as a VM image: %v", err)
	}
	if _, err := Remove(ctx, s, "desktop:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := Lookup(ctx, s, "desktop:1"); !errdefs.IsNotFound(err) {
		t.Fatalf("after rm: %v", err)
	}
	res, err := layer.GC(ctx, s, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.BlobPath(again.Blob.Digest)); !errors.Is(err, os.ErrNotExist) || res.Blobs < 3 {
		t.Fatalf("gc removed %d blobs; the disk: %v", res.Blobs, err)
	}
	if _, err := layer.Resolve(ctx, s, "base:1"); err != nil {
		t.Fatalf("gc took the layer: %v", err)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestBootsThroughFirmware: a VM image built from a Debian tree
// (kernel, initramfs, systemd, systemd-boot) into the store boots as a
// whole machine:
// QEMU's q35 with UEFI firmware (OVMF) finds systemd-boot on the ESP,
// which boots the tree's kernel with the root partition as root, and
// systemd brings the machine up to its login prompt on the serial
// console. The machine runs on a copy-on-write overlay of the stored
// qcow2: the image itself is never written.
func TestBootsThroughFirmware(t *testing.T) {
	layertest.RequireRoot(t)
	for _, p := range []string{OVMFCode, OVMFVars} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%s: %v (make deps installs ovmf)", p, err)
		}
	}
	tree, err := layertest.DebianBootable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	s, err := store.Open(filepath.Join(dir, "store"))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	img, err := Build(context.Background(), s, []string{tree}, must(layer.ParseRef("debian-vm:12")), BuildOptions{DiskOptions: DiskOptions{Seed: t.Name()}})
	if err != nil {
		t.Fatal(err)
	}
	d := img.Disk
	st, err := os.Stat(img.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("built a %d MiB disk (kernel %s), stored as %d MiB of qcow2, in %v", d.Size>>20, d.Kernel, st.Size()>>20, time.Since(start))
	if st.Size() >= d.Size/2 {
		t.Errorf("the stored disk takes %d of its %d bytes", st.Size(), d.Size)
	}
	// Written, the image would change its modification time.
	stamp := func() string {
		st, err := os.Stat(img.Path)
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprint(st.Size(), st.ModTime().UnixNano())
	}
	before := stamp()
	overlay := filepath.Join(dir, "overlay.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", img.Path, "-F", "qcow2", overlay).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v: %s", err, out)
	}
	vars := filepath.Join(dir, "vars.fd")
	if b, err := os.ReadFile(OVMFVars); err != nil || os.WriteFile(vars, b, 0o600) != nil {
		t.Fatal(err)
	}
	qemu := exec.Command("qemu-system-x86_64", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-machine", "q35", "-accel", "tcg,tb-size=64", "-cpu", "qemu64", "-smp", "2", "-m", "1024",
		"-drive", "if=pflash,format=raw,readonly=on,file="+OVMFCode, "-drive", "if=pflash,format=raw,file="+vars,
		"-drive", "if=virtio,format=qcow2,file="+overlay, "-serial", "stdio")
	out, err := qemu.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	qemu.Stderr = qemu.Stdout
	if err := qemu.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		qemu.Process.Kill()
		qemu.Wait()
	}()
	var console strings.Builder
	seen := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(out)
		sc.Split(scanUntilPrompt)
		for sc.Scan() {
			console.WriteString(sc.Text())
			if strings.Contains(sc.Text(), "login:") {
				seen <- nil
				return
			}
		}
		seen <- errors.New("the console ended")
	}()
	booted := time.Now()
	select {
	case err := <-seen:
		if err != nil {
			t.Fatalf("%v before a login prompt:\n%s", err, console.String())
		}
	case <-time.After(6 * time.Minute):
		qemu.Process.Kill()
		<-seen
		t.Fatalf("no login prompt after 6 minutes:\n%s", console.String())
	}
	t.Logf("firmware to login prompt (TCG): %v", time.Since(booted))
	for _, want := range []string{"Linux version " + d.Kernel, "root=PARTUUID=" + d.Root.UUID} {
		if !strings.Contains(console.String(), want) {
			t.Errorf("the console never says %q:\n%s", want, console.String())
		}
	}
	qemu.Process.Kill()
	qemu.Wait()
	if stamp() != before {
		t.Fatal("booting wrote to the image under its overlay")
	}
}

// scanUntilPrompt splits at newlines, and at a line that ends in
// "login: " with no newline yet (getty waits there).
func scanUntilPrompt(data []byte, atEOF bool) (int, []byte, error) {
	if i := strings.IndexByte(string(data), '\n'); i >= 0 {
		return i + 1, data[:i+1], nil
	}
	if strings.HasSuffix(string(data), "login: ") || atEOF && len(data) > 0 {
		return len(data), data, nil
	}
	return 0, nil, nil
}

// rootFile reads path from the root file system of the VM image img
// (debugfs on a raw copy of its disk; nothing mounted).
func rootFile(t *testing.T, img *Image, path string) (string, error) {
	return debugfsOf(t, img, "cat", path)
}

// debugfsOf runs debugfs's request req on path in img's root file system.
func debugfsOf(t *testing.T, img *Image, req, path string) (string, error) {
	t.Helper()
	raw := filepath.Join(t.TempDir(), "disk.raw")
	if out, err := exec.Command("qemu-img", "convert", "-f", "qcow2", "-O", "raw", img.Path, raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v: %s", err, out)
	}
	var stdout, stderr strings.Builder
	cmd := exec.Command("debugfs", "-R", req+" "+path, fmt.Sprintf("%s?offset=%d", raw, img.Disk.Root.Offset))
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("debugfs: %v: %s", err, stderr.String())
	}
	if strings.Contains(stderr.String(), "not found") {
		return "", os.ErrNotExist
	}
	return stdout.String(), nil
}

// TestAgentUnits: a tree with systemd gets the agent's units, enabled,
// and its record says the agent starts so; one without gets none; a
// tree with units of those names is refused, naming the unit.
func TestAgentUnits(t *testing.T) {
	ctx := context.Background()
	s, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	plain := fakeTree(t, "6.1.0-9-amd64")
	img, err := Build(ctx, s, []string{plain}, must(layer.ParseRef("plain:1")), BuildOptions{DiskOptions: DiskOptions{Size: 400 << 20}})
	if err != nil || img.Disk.Agent != "" {
		t.Fatalf("a tree without systemd: %+v %v", img, err)
	}
	if _, err := rootFile(t, img, "/etc/systemd/system/dsec-agent.service"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a tree without systemd got the agent's unit: %v", err)
	}
	tree := fakeTree(t, "6.1.0-9-amd64")
	os.MkdirAll(filepath.Join(tree, "usr/lib/systemd"), 0o755)
	os.WriteFile(filepath.Join(tree, "usr/lib/systemd/systemd"), []byte("systemd"), 0o755)
	img, err = Build(ctx, s, []string{tree}, must(layer.ParseRef("sd:1")), BuildOptions{DiskOptions: DiskOptions{Size: 400 << 20}})
	if err != nil || img.Disk.Agent != AgentSystemd {
		t.Fatalf("a tree with systemd: %+v %v", img, err)
	}
	if got, err := rootFile(t, img, "/etc/systemd/system/dsec-agent.service"); err != nil || got != AgentUnits["dsec-agent.service"] {
		t.Errorf("the agent's service: %q %v", got, err)
	}
	wants := "/etc/systemd/system/multi-user.target.wants/dsec-agent.service"
	if got, err := debugfsOf(t, img, "stat", wants); err != nil || !strings.Contains(got, "Type: symlink") || !strings.Contains(got, `"/etc/systemd/system/dsec-agent.service"`) {
		t.Errorf("%s: %q %v, want a link to the service", wants, got, err)
	}
	if got, err := rootFile(t, img, "/etc/systemd/system/run-dsec-agent.mount"); err != nil || !strings.Contains(got, "What=/dev/disk/by-id/virtio-"+AgentDiskSerial) {
		t.Errorf("the agent disk's mount: %q %v", got, err)
	}
	if got, err := rootFile(t, img, "/etc/hostname"); err != nil || got != "vm\n" {
		t.Errorf("the tree's own files: %q %v", got, err)
	}
	os.MkdirAll(filepath.Join(tree, "etc/systemd/system"), 0o755)
	os.WriteFile(filepath.Join(tree, "etc/systemd/system/dsec-agent.service"), []byte("[Service]\n"), 0o644)
	if _, err := Build(ctx, s, []string{tree}, must(layer.ParseRef("sd:2")), BuildOptions{DiskOptions: DiskOptions{Size: 400 << 20}}); err == nil || !strings.Contains(err.Error(), "its own /etc/systemd/system/dsec-agent.service") {
		t.Fatalf("a tree with the agent's unit name: %v", err)
	}
}

// TestStackedTrees: trees build one image topmost first, as overlayfs
// stacks them: a file of the upper hides the lower's, a whiteout hides
// it, and what only the lower has is there; nothing stays mounted.
func TestStackedTrees(t *testing.T) {
	ctx := context.Background()
	s, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	lower := fakeTree(t, "6.1.0-9-amd64")
	os.WriteFile(filepath.Join(lower, "etc/motd"), []byte("lower\n"), 0o644)
	top := t.TempDir()
	os.MkdirAll(filepath.Join(top, "etc"), 0o755)
	os.WriteFile(filepath.Join(top, "etc/hostname"), []byte("top\n"), 0o644)
	os.WriteFile(filepath.Join(top, "etc/answer"), []byte("42\n"), 0o644)
	if err := unix.Mknod(filepath.Join(top, "etc/motd"), unix.S_IFCHR, 0); err != nil { // a whiteout
		t.Fatal(err)
	}
	img, err := Build(ctx, s, []string{top, lower}, must(layer.ParseRef("stack:1")), BuildOptions{DiskOptions: DiskOptions{Size: 400 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{"/etc/hostname": "top\n", "/etc/answer": "42\n", "/usr/lib/os-release": "NAME=Test\nPRETTY_NAME=\"Test OS 1\"\n"} {
		if got, err := rootFile(t, img, p); err != nil || got != want {
			t.Errorf("%s: %q %v, want %q", p, got, err, want)
		}
	}
	if _, err := rootFile(t, img, "/etc/motd"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a whited-out file: %v", err)
	}
	if img.Source != top+", "+lower || img.Disk.OS != "Test OS 1" {
		t.Errorf("record: source %q, OS %q", img.Source, img.Disk.OS)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "ingest")); len(ents) != 0 {
		t.Errorf("the ingest area after a build: %v", ents)
	}
	if _, err := Build(ctx, s, []string{top, filepath.Join(top, "none")}, must(layer.ParseRef("stack:2")), BuildOptions{}); !errdefs.IsNotFound(err) {
		t.Errorf("a missing lower tree: %v", err)
	}
}

// TestBuildFromLayers: a VM image builds from the store's layers as
// from trees: a layer's EROFS image mounted read-only, stacked topmost
// first over the others through overlayfs, so a file of an upper layer
// hides a lower's and a whiteout (a tar's .wh. entry) removes one; the
// record names the layers; nothing stays mounted; a name that is no
// directory, layer or image is refused in one line.
func TestBuildFromLayers(t *testing.T) {
	ctx := context.Background()
	s, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	base := fakeTree(t, "6.1.0-9-amd64")
	os.WriteFile(filepath.Join(base, "etc/motd"), []byte("base\n"), 0o644)
	lb, err := layer.Build(ctx, s, layer.BuildOptions{Source: base, Kind: layer.KindBase, Ref: must(layer.ParseRef("lb:1"))})
	if err != nil {
		t.Fatal(err)
	}
	// A workspace layer from a tar: a file of its own, one over the
	// base's, and a whiteout of the base's motd.
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, body := range map[string]string{"etc/hostname": "from-a-layer\n", "etc/.wh.motd": "", "root/task": "task\n"} {
		tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg})
		tw.Write([]byte(body))
	}
	tw.Close()
	ws := filepath.Join(t.TempDir(), "ws.tar")
	os.WriteFile(ws, buf.Bytes(), 0o644)
	if _, err := layer.Build(ctx, s, layer.BuildOptions{Source: ws, Kind: layer.KindWorkspace, Ref: must(layer.ParseRef("lw:1"))}); err != nil {
		t.Fatal(err)
	}
	img, err := Build(ctx, s, []string{"lw:1", "lb:1"}, must(layer.ParseRef("fromlayers:1")), BuildOptions{DiskOptions: DiskOptions{Size: 400 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	if img.Disk.Kernel != "6.1.0-9-amd64" || img.Source != "workspace layer lw:1, base layer lb:1" {
		t.Errorf("an image of two layers: kernel %q, source %q", img.Disk.Kernel, img.Source)
	}
	for path, want := range map[string]string{"/etc/hostname": "from-a-layer\n", "/root/task": "task\n", "/sbin/init": "init"} {
		if got, err := rootFile(t, img, path); err != nil || got != want {
			t.Errorf("%s on the image's root: %q %v, want %q", path, got, err, want)
		}
	}
	if _, err := rootFile(t, img, "/etc/motd"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the file an upper layer's whiteout removes is on the image's root: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "ingest")); len(ents) != 0 {
		t.Errorf("the build left %d entries in the store's ingest area (a layer's mount?)", len(ents))
	}
	// A layer alone, from a tar with a whiteout (of nothing below it):
	// stacked too, so the whiteout is no file on the image's root.
	lone := fakeTree(t, "6.1.0-9-amd64")
	os.WriteFile(filepath.Join(lone, "etc/.wh.motd"), nil, 0o644)
	loneTar := filepath.Join(t.TempDir(), "lone.tar")
	if out, err := exec.Command("tar", "-C", lone, "-cf", loneTar, ".").CombinedOutput(); err != nil {
		t.Fatalf("tar: %v: %s", err, out)
	}
	if _, err := layer.Build(ctx, s, layer.BuildOptions{Source: loneTar, Kind: layer.KindBase, Ref: must(layer.ParseRef("lone:1"))}); err != nil {
		t.Fatal(err)
	}
	one, err := Build(ctx, s, []string{"lone:1"}, must(layer.ParseRef("onelayer:1")), BuildOptions{DiskOptions: DiskOptions{Size: 400 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := debugfsOf(t, one, "stat", "/etc/motd"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a lone layer's whiteout is on the image's root: %q %v", got, err)
	}
	if got, err := rootFile(t, one, "/etc/hostname"); err != nil || got != "vm\n" {
		t.Errorf("/etc/hostname of a lone layer's image: %q %v", got, err)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "ingest")); len(ents) != 0 {
		t.Errorf("the build of a lone layer left %d entries in the store's ingest area", len(ents))
	}
	for _, name := range []string{"nosuch:9", "registry.example:5000/nosuch:1", "Bad-Name"} {
		if _, err := Build(ctx, s, []string{name}, must(layer.ParseRef("x:1")), BuildOptions{}); !errdefs.IsNotFound(err) ||
			!strings.Contains(err.Error(), name+" is no directory, nor a layer or an image of the store") {
			t.Errorf("a name of nothing: %v", err)
		}
	}
	if _, err := Build(ctx, s, []string{"./lb:1"}, must(layer.ParseRef("x:1")), BuildOptions{}); !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "no directory") {
		t.Errorf("a path that is no directory, named as one: %v", err)
	}
	// A build killed with its layers mounted: gc unmounts and removes
	// them (the store's lock held: no build runs then).
	left := filepath.Join(s.Dir(), "ingest", "layer.killed")
	if err := os.Mkdir(left, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := mount.EROFS(s.BlobPath(lb.Digest)).Mount(left); err != nil {
		t.Fatal(err)
	}
	// And its stack: an overlay of that layer and a tree, its upper
	// beside it.
	stacked, _, err := stack([]string{left, base}, filepath.Join(s.Dir(), "ingest"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := layer.GC(ctx, s, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(left); !errors.Is(err, os.ErrNotExist) {
		mount.Unmount(left)
		t.Errorf("a killed build's layer mount after gc: %v", err)
	}
	if _, err := os.Stat(filepath.Dir(stacked)); !errors.Is(err, os.ErrNotExist) {
		mount.Unmount(stacked)
		t.Errorf("a killed build's stack after gc: %v", err)
	}
	if _, err := os.Stat(base); err != nil {
		t.Errorf("a tree a killed build stacked, after gc: %v", err)
	}
}

// TestStackHidesWhiteouts: a stack of host trees lists no whiteout,
// not even one in a directory only the top tree has (which overlayfs
// lists as that tree holds it), and keeps that directory's times; the
// trees themselves are left as they were, and unstack leaves nothing.
func TestStackHidesWhiteouts(t *testing.T) {
	layertest.RequireRoot(t)
	top, low, dir := t.TempDir(), t.TempDir(), t.TempDir()
	os.MkdirAll(filepath.Join(top, "only"), 0o755)
	os.WriteFile(filepath.Join(top, "only/kept"), []byte("k"), 0o644)
	os.WriteFile(filepath.Join(low, "gone"), []byte("g"), 0o644)
	for _, p := range []string{"only/nothing", "gone"} { // whiteouts: over nothing, and over a lower's file
		if err := unix.Mknod(filepath.Join(top, p), unix.S_IFCHR, 0); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Unix(1_000_000_000, 0)
	os.Chtimes(filepath.Join(top, "only"), old, old)
	listing := func(root string) string {
		var b strings.Builder
		filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
			if err == nil {
				fmt.Fprintf(&b, "%s %v %d\n", p, fi.Mode(), fi.ModTime().UnixNano())
			}
			return err
		})
		return b.String()
	}
	trees := listing(top) + listing(low)
	tree, unstack, err := stack([]string{top, low}, dir)
	if err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(filepath.Join(tree, "only"))
	if err != nil || len(ents) != 1 || ents[0].Name() != "kept" {
		t.Errorf("a directory of the top tree alone lists %v %v, want kept alone", ents, err)
	}
	if _, err := os.Lstat(filepath.Join(tree, "gone")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a lower's file its upper's whiteout removes: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(tree, "only")); err != nil || !fi.ModTime().Equal(old) {
		t.Errorf("the directory whose whiteout was hidden: %v %v, want its time %v", fi.ModTime(), err, old)
	}
	unstack()
	if got := listing(top) + listing(low); got != trees {
		t.Errorf("the trees after a stack:\n%s\nwant\n%s", got, trees)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("unstack left %d entries", len(ents))
	}
}
