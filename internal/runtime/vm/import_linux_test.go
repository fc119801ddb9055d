package vm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// TestImport: a raw disk with systemd on its ext4 root and no agent is
// imported with the agent's units installed, its partitions and OS read
// from it; a qcow2 disk dsec built keeps its units as they are; with
// --no-agent the disk is stored as it is, and has no agent; a qcow2
// disk that reads a backing file, a disk without a GPT, another format
// and a missing file are refused, saying what to give, and the store
// holds nothing of them.
func TestImport(t *testing.T) {
	ctx := context.Background()
	s, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	// A disk of a tree with systemd, built without the agent: a tree
	// with systemd whose build had no agent is what another tool makes.
	tree := fakeTree(t, "6.1.0-9-amd64")
	os.MkdirAll(filepath.Join(tree, "usr/lib/systemd"), 0o755)
	os.WriteFile(filepath.Join(tree, "usr/lib/systemd/systemd"), []byte("systemd"), 0o755)
	dir := t.TempDir()
	raw, err := os.Create(filepath.Join(dir, "other.img"))
	if err != nil {
		t.Fatal(err)
	}
	d, err := BuildDisk(ctx, tree, raw, DiskOptions{Size: 400 << 20, Seed: "other"})
	raw.Close()
	if err != nil {
		t.Fatal(err)
	}
	// Take its agent's units out again, with debugfs.
	script := filepath.Join(dir, "rm")
	os.WriteFile(script, []byte("rm /etc/systemd/system/multi-user.target.wants/dsec-agent.service\nrm /etc/systemd/system/dsec-agent.service\nrm /etc/systemd/system/run-dsec-agent.mount\n"), 0o600)
	if err := debugfs(ctx, raw.Name()+"?offset="+itoa(d.Root.Offset), script); err != nil {
		t.Fatal(err)
	}
	img, err := Import(ctx, s, raw.Name(), must(layer.ParseRef("imported:1")), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got := img.Disk
	if got.Agent != AgentSystemd || got.OS != "Test OS 1" || got.Size != d.Size || got.ESP != d.ESP || got.Root != d.Root || len(img.Chain) != 1 ||
		!strings.HasPrefix(img.Source, "import of ") {
		t.Fatalf("imported %+v, from %+v", img, d)
	}
	if unit, err := rootFile(t, img, "/etc/systemd/system/dsec-agent.service"); err != nil || unit != AgentUnits["dsec-agent.service"] {
		t.Errorf("the imported disk's agent: %q %v", unit, err)
	}
	if f, err := rootFile(t, img, "/etc/hostname"); err != nil || f != "vm\n" {
		t.Errorf("the imported disk's own files: %q %v", f, err)
	}
	if _, err := Lookup(ctx, s, "imported:1"); err != nil {
		t.Fatal(err)
	}
	// A qcow2 disk dsec built: its units are dsec's, kept.
	q := filepath.Join(dir, "built.qcow2")
	if out, err := exec.Command("qemu-img", "convert", "-O", "qcow2", img.Path, q).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	again, err := Import(ctx, s, q, must(layer.ParseRef("imported:2")), ImportOptions{Format: "qcow2"})
	if err != nil || again.Disk.Agent != AgentSystemd || again.Blob.Digest != img.Blob.Digest {
		t.Fatalf("a disk dsec built, imported: %+v %v (want the same blob %s)", again, err, img.Blob.Digest)
	}
	// --no-agent: the bytes as they were, no agent.
	bare, err := Import(ctx, s, raw.Name(), must(layer.ParseRef("bare:1")), ImportOptions{NoAgent: true})
	if err != nil || bare.Disk.Agent != "" || bare.Blob.Digest == img.Blob.Digest {
		t.Fatalf("--no-agent: %+v %v", bare, err)
	}
	if _, err := rootFile(t, bare, "/etc/systemd/system/dsec-agent.service"); err == nil {
		t.Error("--no-agent installed the agent")
	}
	// Refused: each one line saying what to give.
	over := filepath.Join(dir, "over.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", q, over).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	noGPT := filepath.Join(dir, "blank.img")
	os.WriteFile(noGPT, make([]byte, 4<<20), 0o644)
	vdi := filepath.Join(dir, "disk.vdi")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "vdi", vdi, "64M").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	for _, c := range []struct {
		path, format, says string
		class              func(error) bool
	}{
		{over, "", "reads a backing file", errdefs.IsInvalidArgument},
		{noGPT, "", "no GPT partition table", errdefs.IsInvalidArgument},
		{vdi, "", "is a vdi disk: dsec imports raw and qcow2", errdefs.IsInvalidArgument},
		{raw.Name(), "vmdk", `format "vmdk"`, errdefs.IsInvalidArgument},
		{raw.Name(), "qcow2", "is no disk image qemu-img reads", errdefs.IsInvalidArgument},
		{filepath.Join(dir, "nosuch.img"), "", "no disk image", errdefs.IsNotFound},
	} {
		_, err := Import(ctx, s, c.path, must(layer.ParseRef("bad:1")), ImportOptions{Format: c.format})
		if !c.class(err) || !strings.Contains(err.Error(), c.says) || strings.Contains(err.Error(), "\n") {
			t.Errorf("import %s (format %q): %v, want one line saying %q", c.path, c.format, err, c.says)
		}
	}
	if _, err := Lookup(ctx, s, "bad:1"); !errdefs.IsNotFound(err) {
		t.Errorf("a refused import left a tag: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "ingest")); len(ents) > 0 {
		t.Errorf("imports left %d files in the ingest area", len(ents))
	}
	if _, err := Import(ctx, s, raw.Name(), must(layer.ParseRef("imported:1")), ImportOptions{}); !errdefs.IsAlreadyExists(err) {
		t.Errorf("an import over a tag: %v", err)
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
