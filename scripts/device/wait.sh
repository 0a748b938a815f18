# Wait up to $1 seconds for scripts/device/driver.sh, then pack what it wrote so far (/tmp/res)
# into $OUT/res.tar.gz:  bash scripts/device/wait.sh SECONDS
end=$(( $(date +%s) + $1 ))
while [ ! -e /tmp/res/ALL_DONE ] && [ $(date +%s) -lt $end ]; do sleep 5; done
cat /tmp/res/progress.txt 2>/dev/null
tail -c 3000 /tmp/res/cuda-tests.log 2>/dev/null | grep -v DEBUG | tail -25
tar czf $OUT/res.tar.gz -C /tmp res 2>/dev/null
ls -la $OUT
